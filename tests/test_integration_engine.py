"""The engine on the real embedded model (SmolLM2-135M: fp32, and the dtype --dtype auto takes for prompts reusing
others' positions) and the CLI."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from knnssd import prompts
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import DrafterConfig, build
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.skip import SkipMask
from cli_cases import run_cli
from tiny import tiny_gguf

pytestmark = pytest.mark.integration
MAX_NEW = 16


def test_smollm2_speculative_equals_hf_generate(smollm2, data_dir):
    dec = smollm2.decoder
    assert isinstance(dec, Decoder)
    n = dec.n_layers
    configs = [
        DrafterConfig(kind="ngram", max_len=8),
        DrafterConfig(kind="layer_skip", mask=SkipMask.from_layers(n, attn=[25], mlp=[27, 28]).to_dict(), max_len=4,
                      threshold=0.3),
        DrafterConfig(kind="hybrid", mask=SkipMask.none(n).to_dict(), max_len=6, threshold=0.5, int8=True),
    ]
    rows = prompts.load_domains(data_dir, prompts.DOMAINS, "eval", 1)
    assert len(rows) == 5
    for i, row in enumerate(rows):  # each prompt: plain decoding and one drafter (each drafter on 1-2 prompts)
        ids = smollm2.tokenizer(row.prompt).input_ids
        x = torch.tensor([ids])
        ref = smollm2.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                                     pad_token_id=2)[0, len(ids):].tolist()
        cfg = GenerationConfig(max_new_tokens=MAX_NEW, eos_ids=(2,))
        assert generate(dec, ids, None, cfg)[0] == ref, row.id
        c = configs[i % len(configs)]
        out, stats = generate(dec, ids, build(c, n), cfg)
        assert out == ref, (row.id, c.describe())
        assert stats.drafted > 0 or c.kind == "ngram"


def test_smollm2_batched_equals_each_prompts_own_plain_decoding(smollm2, data_dir):
    """12 eval prompts of the five domains, of different lengths, through 4 slots, with plain, n-gram,
    int8-hybrid and layer-skip drafters: every prompt's tokens equal its own plain decoding (fp32)."""
    from knnssd.engine.batch import plan as batch_plan
    from knnssd.engine.batch.scheduler import BatchStats, PromptJob, decode_batch

    dec = smollm2.decoder
    n = dec.n_layers
    cfgs = [None, DrafterConfig(kind="ngram", max_len=8, adaptive=True),
            DrafterConfig(kind="hybrid", mask=SkipMask.none(n).to_dict(), max_len=6, threshold=0.5, int8=True),
            DrafterConfig(kind="layer_skip", mask=SkipMask.from_layers(n, attn=[25], mlp=[27, 28]).to_dict(), max_len=4,
                          threshold=0.3)]
    rows = prompts.load_domains(data_dir, prompts.DOMAINS, "eval", 3)
    rows = [rows[3 * d + j] for j in range(3) for d in range(5)][:12]  # round-robin over the domains
    assert len({r.domain for r in rows}) == 5 and len({len(smollm2.tokenizer(r.prompt).input_ids) for r in rows}) > 8
    ids = [smollm2.tokenizer(r.prompt).input_ids for r in rows]
    plan = batch_plan.plan(dec, 4, record=smollm2.batch_record)
    assert plan.exact
    jobs = [PromptJob(x, build(cfgs[i % 4], n) if cfgs[i % 4] else None,
                      GenerationConfig(max_new_tokens=12 - 4 * (i % 2), eos_ids=(2,))) for i, x in enumerate(ids)]
    stats = BatchStats(4)
    done = {id(f.job): f for f in decode_batch(dec, jobs, plan, stats)}
    assert len(done) == 12 and stats.prefills == 12 and max(stats.active) == 4
    for row, job in zip(rows, jobs):
        assert done[id(job)].tokens == generate(dec, job.prompt_ids, None, job.config)[0], row.id
    assert sum(stats.drafted) > 0


def test_smollm2_few_shot_prompts_reuse_their_example_in_a_batch(smollm2, data_dir):
    """Summarization eval prompts all start with the same example article (354 tokens): in the dtype
    ``--dtype auto`` takes here (bf16 where it is fast, else fp32), where the probe measures reuse exact,
    each one that starts while another is in the batch copies the example from it (all 354 positions where
    the prefill's attention is the native kernel, as in fp32, else its two leading blocks), a reasoning
    prompt that shares nothing with them copies nothing, and every prompt's tokens still equal its own
    plain decoding. (On an AVX2-only CPU, where auto is fp32, this took 240 s in bf16 and takes 36 s; a Zen 1.)"""
    from knnssd import models
    from knnssd.engine.batch import plan as batch_plan
    from knnssd.engine.batch.scheduler import BatchStats, PromptJob, decode_batch
    from knnssd.engine.spec.loop import reusable, reuse_unit_of

    dtype = models.resolve_dtype("auto", smollm2.device)
    lm = smollm2 if dtype == torch.float32 else models.load("smollm2", dtype="bfloat16")
    dec = lm.decoder
    plan = batch_plan.plan(dec, 3, record=lm.batch_record)
    if not plan.reuses_prefixes:
        pytest.skip(f"reusing a prompt's leading positions is not measured exact in {dtype} here")
    rows = prompts.load_domains(data_dir, ("summarization", "reasoning"), "eval", 3)[:4]  # 3 summarization, 1 other
    ids = [lm.tokenizer(r.prompt).input_ids for r in rows]
    jobs = [PromptJob(x, build(DrafterConfig(kind="ngram", max_len=8), dec.n_layers) if i % 2 else None,
                      GenerationConfig(max_new_tokens=6 + 4 * i, eos_ids=(2,))) for i, x in enumerate(ids)]
    stats = BatchStats(3)
    done = {id(f.job): f for f in decode_batch(dec, jobs, plan, stats)}
    for row, job in zip(rows, jobs):
        assert done[id(job)].tokens == generate(dec, job.prompt_ids, None, job.config)[0], row.id
    unit = reuse_unit_of(dec)
    assert stats.reused == sum(reusable(354, len(x), unit) for x in ids[1:3])  # the 2nd and 3rd summarization prompts


def _waiting_on_locks() -> set[int]:
    """PIDs blocked on a file lock (``/proc/locks`` marks their lines with ``->``)."""
    pids = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields:
            pids.add(int(fields[fields.index("->") + 4]))
    return pids


def test_concurrent_loads_share_one_converted_cache(tmp_path, monkeypatch):
    """Two processes load one GGUF at once: both wait on the conversion lock (held here until they
    do), then one converts while the other waits; both load the same folder, with no temp leftovers
    (nor torch's compile cache folder, which loading makes). A tiny GGUF: the race is the point, not the size."""
    from knnssd import conversion

    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    code = f"from knnssd import models; lm = models.load({str(gguf)!r}, dtype='float32'); print(lm.fingerprint)"
    target = conversion._converted_dir(gguf, gguf.stem)
    with conversion._locked(target):
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        deadline = time.time() + 120
        while time.time() < deadline and not {p.pid for p in procs} <= _waiting_on_locks():
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-500:] for p in procs]
            time.sleep(0.1)
        assert {p.pid for p in procs} <= _waiting_on_locks(), "both loads should wait on the conversion lock"
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    assert outs[0][0].strip() == outs[1][0].strip()
    folders = sorted(p.name for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir())
    assert folders == [target.name], folders
    assert not list((tmp_path / "tmp").iterdir())


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, smollm2):
    """A 2-layer random Llama with SmolLM2's tokenizer: exercises the CLI in seconds."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(smollm2.tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, eos_token_id=2,
                         bos_token_id=1, pad_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-llama")
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    return folder


def test_bench_engine_json(tiny_with_tokenizer, data_dir):
    out = subprocess.run(
        [sys.executable, "-m", "knnssd.cli", "bench-engine", "--model", str(tiny_with_tokenizer), "--dtype", "float32",
         "--prompts", "1", "--max-new-tokens", "8", "--domains", "reasoning,translation", "--data", str(data_dir),
         "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["prompts"] == 2 and report["backend"] == "Decoder"
    assert {"tokens_per_s"} <= set(report["ar"]) and "own_ar_speedup_vs_hf" in report["hf_generate"]
    assert set(report["steps"]["verify_cost_vs_one"]) == {str(k) for k in range(1, 13)}
    assert len(report["steps"]["ms_per_draft_step"]) >= 3
    for name, d in report["drafters"].items():
        assert {"speedup_vs_ar", "acceptance_rate", "mean_accepted", "agreement_with_ar"} <= set(d), name
        assert d["agreement_with_ar"] == 1.0, name  # fp32: exact


def test_cli_bad_input_is_one_line(tmp_path):
    mask = tmp_path / "mask.json"
    mask.write_text(SkipMask.from_layers(4, attn=[1]).to_json())
    cases = [(["complete", "--prompt", "hi", "--model", "nope"], "unknown model 'nope'"),
             (["complete", "--prompt", " ", "--model", "smollm2"], "empty prompt"),
             (["complete", "--prompt", "hi", "--mask", str(mask), "--max-new-tokens", "4"],
              "skip mask is for 4 layers; the model has 30")]
    for (argv, message), res in zip(cases, run_cli([argv for argv, _ in cases])):
        assert res.code == 2 and res.stderr[-1].startswith("knnssd: error:") and message in res.stderr[-1], res
