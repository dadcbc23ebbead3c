"""The speculative loop (``engine/spec/loop.py``) on tiny random models: where it stops, and that it
leaves the model's config alone."""
import pytest

from knnssd.engine.model.build import make_decoder
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.spec.drafters import DrafterConfig, build
from knnssd.engine.spec.loop import GenerationConfig, generate
from tiny import prompt_ids, tiny


def test_stops_at_eos_length_and_stop_string():
    model = tiny("llama")
    dec = make_decoder(model)
    ids = prompt_ids("llama", 0)
    full, _ = generate(dec, ids, None, GenerationConfig(max_new_tokens=20))
    out, st = generate(dec, ids, None, GenerationConfig(max_new_tokens=20, eos_ids=(full[5],)))
    assert out == full[: full.index(full[5]) + 1] and st.stop == "eos"
    out, st = generate(dec, ids, None, GenerationConfig(max_new_tokens=7))
    assert out == full[:7] and st.stop == "length"

    class Tok:  # decodes token t as a letter, so a stop string is a run of tokens
        def decode(self, ids):
            return "".join(chr(97 + t % 26) for t in ids)

    stop = Tok().decode(full[3:5])
    out, st = generate(dec, ids, build(DrafterConfig(kind="ngram"), 4), GenerationConfig(max_new_tokens=20, stop_strings=(stop,)), Tok())
    assert st.stop == "stop_string" and stop in Tok().decode(out) and len(out) <= 5
    with pytest.raises(ValueError, match="empty prompt"):
        generate(dec, [], None, GenerationConfig())


def test_decoding_never_touches_the_config():
    model = tiny("gemma3")
    before = model.config.to_dict()
    dec = make_decoder(model)
    cfg = DrafterConfig(kind="hybrid", mask=SkipMask.from_layers(4, attn=[1, 2]).to_dict(), int8=True)
    generate(dec, prompt_ids("gemma3", 1), build(cfg, 4), GenerationConfig(max_new_tokens=12))
    assert model.config.to_dict() == before
