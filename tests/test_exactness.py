"""Greedy speculative decoding is token-identical to HF generate (fp32), whatever the drafter."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import DrafterConfig, build
from knnssd.engine.model.build import make_decoder
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.hf_decoder import HFDecoder
from knnssd.engine.model.skip import SkipMask
from tiny import ARCHS, hf_greedy, prompt_ids, tiny

MAX_NEW = 24
_decoders: dict[str, Decoder] = {}


def decoder(arch: str):
    if arch not in _decoders:
        _decoders[arch] = make_decoder(tiny(arch))
    return _decoders[arch]


def config(model) -> GenerationConfig:
    eos = model.generation_config.eos_token_id
    return GenerationConfig(max_new_tokens=MAX_NEW, eos_ids=(eos,) if isinstance(eos, int) else tuple(eos or ()))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_lean_forward_is_used_and_plain_ar_matches_hf(arch):
    dec = decoder(arch)
    assert isinstance(dec, Decoder), f"{arch} fell back to HF forwards"
    for i in range(3):
        out, stats = generate(dec, prompt_ids(arch, i), None, config(tiny(arch)))
        assert tuple(out) == hf_greedy(arch, i, MAX_NEW)
        assert stats.drafted == 0 and stats.mean_accepted == 1.0


def drafter_configs(n_layers: int):
    skip_p = st.sampled_from([0.0, 0.15, 0.5, 0.9])

    @st.composite
    def make(draw):
        p = draw(skip_p)
        bits = draw(st.lists(st.floats(0, 1), min_size=2 * n_layers, max_size=2 * n_layers))
        mask = SkipMask.from_bits([b < p for b in bits])
        return DrafterConfig(
            kind=draw(st.sampled_from(["layer_skip", "ngram", "hybrid"])),
            mask=mask.to_dict(),
            max_len=draw(st.integers(1, 10)),
            threshold=draw(st.sampled_from([0.0, 0.0, 0.3, 0.8])),
            int8=draw(st.booleans()),
            ngram_sizes=draw(st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True)),
        )

    return make()


@given(arch=st.sampled_from(sorted(ARCHS)), prompt=st.integers(0, 3), data=st.data())
def test_speculative_greedy_equals_hf_generate(arch, prompt, data):
    model = tiny(arch)
    cfg = data.draw(drafter_configs(model.config.num_hidden_layers))
    dec = decoder(arch)
    out, stats = generate(dec, prompt_ids(arch, prompt), build(cfg, dec.n_layers), config(model))
    assert tuple(out) == hf_greedy(arch, prompt, MAX_NEW), cfg.describe()
    assert stats.new_tokens == len(out)
    assert sum(stats.accepted) <= stats.drafted


def test_exact_drafts_are_all_accepted():
    """A drafter that skips nothing drafts what the model would say: every draft is accepted."""
    dec = decoder("llama")
    cfg = DrafterConfig(kind="layer_skip", mask=SkipMask.none(4).to_dict(), max_len=5)
    out, stats = generate(dec, prompt_ids("llama", 0), build(cfg, 4), config(tiny("llama")))
    assert tuple(out) == hf_greedy("llama", 0, MAX_NEW)
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted > 4


def test_unknown_architecture_falls_back_to_hf_forwards():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                             initializer_range=0.2)).eval()
    dec = make_decoder(model)
    assert isinstance(dec, HFDecoder)
    ids = list(range(5, 17)) * 2
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    cfg = GenerationConfig(max_new_tokens=20)
    assert generate(dec, ids, None, cfg)[0] == ref
    assert generate(dec, ids, build(DrafterConfig(kind="ngram", max_len=4), 2, can_skip=False), cfg)[0] == ref
