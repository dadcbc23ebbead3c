"""Batched speculative decoding (engine/batch/scheduler.py): every sequence's tokens equal its own plain
decoding, sampling keeps each sequence's distribution, slots are refilled, and draft lengths come
from goodput."""
import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from knnssd.engine.batch import plan as batch_plan
from knnssd.engine.batch import draft_lengths
from knnssd.engine.model import pass_costs
from knnssd.engine.batch import prefixes
from knnssd.engine.model.attention import CAUSAL_BLOCK, PREFILL_ROWS
from knnssd.engine.batch.plan import BatchPlan
from knnssd.engine.batch.scheduler import BatchStats, PromptJob, decode_batch
from knnssd.engine.batch.draft_lengths import choose_lengths
from knnssd.engine.model.pass_costs import PassCosts
from knnssd.engine.spec.loop import GenerationConfig, Reused, generate, prefill, reusable, reuse_unit_of
from knnssd.engine.spec.drafters import DrafterConfig, build
from knnssd.engine.spec.sampling import Warp
from knnssd.engine.model.build import make_decoder
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.skip import SkipMask
from test_sampling import ALPHA, chi2_pvalue, exact_joint
from tiny import prompt_ids, tiny

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLAT = PassCosts((1, 64), (1.0, 1.0))  # a pass costs the same for any row count, far more than a draft: drafting pays


@functools.lru_cache(maxsize=None)
def decoder(arch: str, dtype: str):
    return make_decoder(tiny(arch, dtype=DTYPES[dtype]))


def drafters(n_layers: int) -> list[DrafterConfig | None]:
    mask = SkipMask.from_layers(n_layers, attn=[1], mlp=[n_layers - 1]).to_dict()
    return [None, DrafterConfig(kind="ngram", max_len=5, adaptive=True),
            DrafterConfig(kind="layer_skip", mask=mask, max_len=4, threshold=0.2),
            DrafterConfig(kind="hybrid", mask=mask, max_len=6, int8=True, adaptive=True)]


def mixed_jobs(dec, arch: str, n: int, max_new: int) -> list[PromptJob]:
    """n prompts of different lengths (6..24 tokens, or 46..64: two key lengths), drafters and token
    budgets, each job its own drafter."""
    cfgs = drafters(dec.n_layers)
    jobs = []
    for i in range(n):
        ids = prompt_ids(arch, i, length=6 + (i * 7) % 19 + (i % 2) * 40)
        cfg = cfgs[i % len(cfgs)]
        jobs.append(PromptJob(ids, build(cfg, dec.n_layers) if cfg else None,
                              GenerationConfig(max_new_tokens=max_new - (i % 3) * 4)))
    return jobs


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_batched_greedy_equals_each_prompts_own_plain_decoding(arch, dtype):
    dec = decoder(arch, dtype)
    plan = batch_plan.plan(dec, slots=4)
    if dtype == "bfloat16" and not (dec.exactness.exact and plan.exact):
        pytest.skip(f"no exact packed bf16 pass here: {dec.exactness.note or 'packed linears not row-invariant'}")
    assert plan.exact, "fp32 must be exact"
    assert plan.pooled == (dec.attention.poolable and batch_plan.pooled_exact(dec, 4))
    # flat pass costs, not the ones timed here: a timing taken on a loaded machine could make no draft pay, and
    # this test is of drafted output
    plan = dataclasses.replace(plan, costs=PassCosts((1, 64), (0.01, 0.01)))
    jobs = mixed_jobs(dec, arch, 13, 20)
    stats = BatchStats(plan.slots)
    done = list(decode_batch(dec, jobs, plan, stats))
    assert sorted(id(f.job) for f in done) == sorted(id(j) for j in jobs)  # 13 jobs through 4 slots: refilled
    for f in done:
        want = generate(dec, f.job.prompt_ids, None, f.job.config)[0]
        assert f.tokens == want, (arch, dtype, f.job.drafter)
        assert f.stats.exact and f.stats.new_tokens == len(f.tokens)
    assert max(stats.active) == 4 and stats.prefills == 13
    assert stats.tokens == sum(len(f.tokens) for f in done)
    assert sum(stats.drafted) > 0


def test_the_scheduler_shows_each_step_the_tokens_emitted_so_far():
    """``Scheduler(on_step=...)``: after each step the hook sees every active run, whose tokens so far are a
    prefix of what it finishes with (what a server streams), and the hook's last view of a run is its end."""
    from knnssd.engine.batch.scheduler import Scheduler

    dec = decoder("llama", "float32")
    plan = batch_plan.plan(dec, slots=3)
    jobs = mixed_jobs(dec, "llama", 5, 16)
    seen: dict[int, list[list[int]]] = {}
    alive = []  # a finished run freed here could hand its id to a later one and merge their views

    def hook(runs):
        alive.extend(runs)
        for r in runs:
            seen.setdefault(id(r), []).append(list(r.new))

    runs = {}
    sched = Scheduler(dec, jobs, plan, on_step=hook)
    done = list(sched.run())
    for a in done:
        runs[id(a.job)] = a.tokens
    assert len(done) == 5 and sched.stats.steps == len(sched.stats.rows) > 0
    ends = {tuple(views[-1]) for views in seen.values()}
    assert ends <= {tuple(t) for t in runs.values()}  # a run's last view is its whole output
    for views in seen.values():
        assert all(a == b[: len(a)] and len(a) < len(b) for a, b in zip(views, views[1:]))  # only grows


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prompts_reuse_the_leading_positions_of_others_in_the_batch(arch):
    """Few-shot prompts (one example of two blocks and 30 tokens, then their own text) and a lone one:
    where the probe measures reuse exact (on the CPU: bf16 with native or blocked prefill attention, fp32
    where the prefill runs the native step's kernel), those that start while another is in the batch
    copy its K/V for the example (all of it where a native kernel computes each prefill row alone, else
    its two blocks); every prompt's tokens equal its own plain decoding either way."""
    example = prompt_ids(arch, 0, length=2 * CAUSAL_BLOCK + 30)
    prompts = [example + prompt_ids(arch, i, length=20 + 9 * i) for i in range(1, 6)] + [prompt_ids(arch, 9, 300)]
    shared = []
    for dtype in ("bfloat16", "float32"):
        dec = decoder(arch, dtype)
        plan = batch_plan.plan(dec, slots=3)
        assert plan.reuses_prefixes == prefixes.prefix_exact(dec, plan.pooled)
        cfgs = drafters(dec.n_layers)
        jobs = [PromptJob(ids, build(cfgs[i % 4], dec.n_layers) if cfgs[i % 4] else None,
                          GenerationConfig(max_new_tokens=6 + 3 * i)) for i, ids in enumerate(prompts)]
        stats = BatchStats(plan.slots)
        done = list(decode_batch(dec, jobs, plan, stats))
        assert len(done) == len(jobs)
        for f in done:
            assert f.tokens == generate(dec, f.job.prompt_ids, None, f.job.config)[0], (arch, dtype)
        # the first three start together (the 2nd and 3rd reuse the 1st's example); each later one while
        # an earlier one still runs
        unit = reuse_unit_of(dec)
        assert stats.reused == (len(example) // unit * unit * 4 if plan.reuses_prefixes else 0), (dtype, stats.reused)
        shared += [dtype] * plan.reuses_prefixes
    if not shared:
        pytest.skip("reuse is measured exact in no dtype here")


def test_a_prompt_reuses_one_that_finished_while_its_slot_stays_free():
    """A server's requests one after another, on a running batch of 3 slots: each few-shot prompt starts
    only after the one before it finished, and still copies the example from that one's free slot (the
    slot it takes is another: the one free longest); its tokens equal its own plain decoding."""
    from knnssd.engine.batch.scheduler import JobQueue

    example = prompt_ids("llama", 0, length=2 * CAUSAL_BLOCK + 30)
    prompts = [example + prompt_ids("llama", i, length=20 + 9 * i) for i in range(1, 5)]
    shared = []
    for dtype in ("bfloat16", "float32"):
        dec = decoder("llama", dtype)
        plan = batch_plan.plan(dec, slots=3)
        queue, stats = JobQueue(), BatchStats(plan.slots)
        batch = decode_batch(dec, queue, plan, stats)
        for ids in prompts:
            job = PromptJob(ids, None, GenerationConfig(max_new_tokens=5))
            queue.put(job)
            f = next(batch)  # the batch holds this job alone, and yields it once it has finished
            assert f.job is job and f.tokens == generate(dec, ids, None, job.config)[0], dtype
        queue.close()
        assert list(batch) == [] and max(stats.active) == 1
        unit = reuse_unit_of(dec)
        assert stats.reused == (len(example) // unit * unit * 3 if plan.reuses_prefixes else 0), (dtype, stats.reused)
        shared += [dtype] * plan.reuses_prefixes
    if not shared:
        pytest.skip("reuse is measured exact in no dtype here")


def test_reuse_takes_whole_units_and_leaves_a_prefill_to_compute():
    """What may be reused is whole units (blocks, or single positions where the prefill's attention is the
    native kernel) leaving more than PREFILL_ROWS rows (a shorter call would run as a verify pass): a
    borrower with fewer reuses what leaves it that many, and prefill refuses a reuse that leaves fewer."""
    dec = decoder("llama", "bfloat16")
    B = CAUSAL_BLOCK
    cases = ((300, 300), (2 * B, 2 * B + 17), (2 * B, 2 * B + 16), (B - 1, 400))
    assert [reusable(c, n, B) for c, n in cases] == [2 * B, 2 * B, B, 0]
    assert [reusable(c, n, 1) for c, n in cases] == [300 - PREFILL_ROWS - 1, 2 * B, 2 * B - 1, B - 1]
    store = prefixes.Prefixes()
    cfg = GenerationConfig(max_new_tokens=1)
    store.prefill(dec.slot(), prompt_ids("llama", 0, length=B + 40), cfg)
    short = prompt_ids("llama", 0, length=B + 40)[:B] + [5] * 10  # the lender's block, then too few rows of its own
    store.prefill(dec.slot(), short, cfg)
    assert store.reused == reusable(B, len(short), reuse_unit_of(dec))
    slot = dec.slot()
    prefill(slot, short, cfg)
    with pytest.raises(ValueError, match="cannot reuse"):  # a reuse that would leave a verify-sized rest
        prefill(dec.slot(), short, cfg, None, Reused(B, slot.cache, torch.zeros(B, 1), None))


def test_at_most_one_prefill_per_step_while_others_run():
    dec = decoder("llama", "float32")
    plan = BatchPlan(3, FLAT, True)
    starts = []

    class Counting(PromptJob):
        def start(self, slot, prefill):
            starts.append(len(stats.rows))  # the step count when this job's prefill ran
            return super().start(slot, prefill)

    stats = BatchStats(3)
    jobs = [Counting(prompt_ids("llama", i), None, GenerationConfig(max_new_tokens=2 + i % 4)) for i in range(9)]
    assert len(list(decode_batch(dec, jobs, plan, stats))) == 9
    assert starts[:3] == [0, 0, 0]  # the first slots fill before any step
    later = starts[3:]
    assert len(later) == len(set(later)), "two prefills between the same two steps"


def test_batched_sampling_keeps_each_sequences_distribution():
    """Each job is one sequence with its own seed; across jobs the first three tokens follow the
    model's exact distribution (the chi-square test of test_sampling.py), in batches of 8 slots."""
    model = tiny("llama")
    dec = make_decoder(model)
    warp = Warp(1.2, top_k=5, top_p=0.9)
    prompt = prompt_ids("llama", 1)
    expected = exact_joint(model, prompt, warp)
    cfg = DrafterConfig(kind="hybrid", mask=SkipMask.from_layers(4, attn=[2], mlp=[1]).to_dict(), max_len=3,
                        ngram_sizes=[2, 1])
    n = 1200
    jobs = [PromptJob(prompt, build(cfg, dec.n_layers), GenerationConfig(max_new_tokens=4, warp=warp, seed=s))
            for s in range(n)]
    stats = BatchStats(8)
    counts: dict[tuple, int] = {}
    for f in decode_batch(dec, jobs, BatchPlan(8, FLAT, True, pooled=dec.attention.poolable), stats):
        key = tuple(f.tokens[:3])
        counts[key] = counts.get(key, 0) + 1
    assert sum(stats.drafted) > n / 2
    assert chi2_pvalue(counts, expected, n) > ALPHA


def geo(accept: list[float], cap: int = 12) -> list[list[float]]:
    """s_b(j) = a_b^j: each drafted token accepted alone with chance a_b."""
    return [[a ** j for j in range(1, cap + 1)] for a in accept]


def test_choose_lengths_from_goodput():
    flat = PassCosts((1, 100), (0.01, 0.01))
    steep = PassCosts((1, 2, 100), (0.01, 0.02, 1.0))  # every row costs a whole pass: drafts never pay
    # flat costs, free drafts: draft everything
    assert choose_lengths([4, 3], geo([0.8, 0.5]), [0.0, 0.0], flat) == [4, 3]
    # steep costs: plain batched decoding
    assert choose_lengths([4, 3], geo([0.8, 0.9]), [0.0, 0.0], steep) == [0, 0]
    # a costly drafter with poor acceptance drafts nothing; a free one with good acceptance drafts
    assert choose_lengths([4, 4], geo([0.9, 0.2]), [0.0, 0.02], flat) == [4, 0]
    # a call's cost is paid once, whatever its length: a long draft with fair acceptance pays for it
    assert choose_lengths([8], geo([0.6]), [0.008], flat) == [8]
    # caps bound the lengths, and zero caps stay zero
    assert choose_lengths([2, 0], geo([0.99, 0.99]), [0.0, 0.0], flat) == [2, 0]
    # as the batch grows on a rising cost curve, drafts shrink
    rising = PassCosts((1, 8, 16, 64), (0.010, 0.011, 0.014, 0.060))
    small = sum(choose_lengths([6] * 2, geo([0.7] * 2), [0.0] * 2, rising))
    large = sum(choose_lengths([6] * 16, geo([0.7] * 16), [0.0] * 16, rising))
    assert small / 2 > large / 16
    # runs of acceptance (all of a draft or none of it, one time in three) pay for long drafts where the
    # same per-token rate would not
    runs = [[1 / 3] * 8]
    slope = PassCosts((1, 9), (0.010, 0.014))
    assert choose_lengths([8], runs, [0.0], slope) == [8] and choose_lengths([8], geo([1 / 3]), [0.0], slope)[0] < 3


def test_draft_model_shrinks_each_sequence_towards_its_kind():
    from types import SimpleNamespace as NS

    from knnssd.engine.spec.drafters import Hybrid, NGram

    def run(drafter, calls: int = 0, seconds: float = 0.0, tried=(), kept=()):
        return NS(drafter=drafter, trees=False, stats=NS(draft_calls=calls, draft_s=seconds, drafted_at=list(tried),
                                                         accepted_at=list(kept)))

    ngram, hybrid = object.__new__(NGram), object.__new__(Hybrid)
    model = draft_lengths.DraftModel()
    p = draft_lengths.DraftModel.PRIOR
    # nothing measured yet: a new sequence is free to draft with s(j) = 1/2^j (and is then measured);
    # a plain one has no draft
    s, d = model([run(hybrid), run(None)], [3, 0])
    assert d == [0.0, 0.0] and s == [[0.5, 0.25, 0.125], []]
    model.finished(run(hybrid, 10, 0.1, tried=[10, 8], kept=[6, 4]))
    active = [run(hybrid), run(ngram, 4, 0.004, tried=[4, 4], kept=[4, 2]), run(hybrid, 10, 0.3, [10], [2])]
    s, d = model(active, [2, 2, 2])
    hybrid_d = 0.4 / (20 + p)  # the finished and the active hybrid together, per call, shrunk towards 0
    assert abs(d[0] - hybrid_d) < 1e-12  # its kind's
    assert abs(d[2] - (0.3 + p * hybrid_d) / (10 + p)) < 1e-12  # its own, shrunk towards its kind's
    hybrid_s = [(8 + p / 2) / (20 + p), (4 + p / 4) / (8 + p)]  # by position, shrunk towards 1/2^j
    assert abs(s[0][0] - hybrid_s[0]) < 1e-12 and s[0][1] == s[0][0]  # never rising with j (0.42 at j = 2)
    assert abs(s[2][0] - (2 + p * hybrid_s[0]) / (10 + p)) < 1e-12 and s[2][1] == s[2][0]
    assert s[1][0] > s[1][1] > 0.5 ** 2  # n-gram hits: four of four, then two of four
    # one slow call does not price a sequence of a cheap kind out of drafting: it moves a fifth of the way
    model.finished(run(ngram, 100, 0.01))
    assert model([run(ngram, 1, 0.05)], [0])[1][0] < 0.05 / 4


def test_pass_costs_interpolate_and_slot_memory():
    c = PassCosts((1, 4, 8), (0.01, 0.02, 0.04))
    assert c(1) == 0.01 and c(4) == 0.02 and abs(c(6) - 0.03) < 1e-12 and abs(c(12) - 0.06) < 1e-12
    j = PassCosts((16, 64), (0.03, 0.08)).joined(PassCosts((1, 12), (0.02, 0.025)))
    assert j.rows == (1, 12, 16, 64) and j(1) == 0.02 and abs(j(14) - 0.0275) < 1e-12  # not flat below 16
    dec = decoder("llama", "float32")
    measured = pass_costs.measure_pass_costs(dec, slots=2, per_seq=(1, 4), repeats=1)
    assert measured.rows == (2, 8) and all(s > 0 for s in measured.seconds)
    per = batch_plan.slot_bytes(dec, 100)
    assert per == 2 * dec.n_layers * dec.stack.n_kv * dec.stack.head_dim * 128 * 4  # fp32 K/V, 2 buckets
    assert batch_plan.max_slots(dec, 100, memory=10 * per + 1) == 10 and batch_plan.max_slots(dec, 100, memory=1) == 1


def test_plan_allocates_the_longest_job_within_memory_and_the_pool_never_regrows():
    dec = decoder("llama", "float32")
    assert batch_plan.plan(dec, 3).positions == 0  # unknown: slots grow as jobs reserve
    per = batch_plan.slot_bytes(dec, 64) // 64  # bytes per position of one slot
    plan = batch_plan.plan(dec, 3, positions=100)
    assert plan.positions == 128  # one bucket past 100
    assert batch_plan.plan(dec, 3, positions=10**6, memory=3 * 200 * per).positions == 192  # what fits, in buckets
    grown = []
    jobs = [PromptJob(prompt_ids("llama", i, length=20 + 30 * i), None, GenerationConfig(max_new_tokens=4))
            for i in range(3)]  # prompts up to 80 tokens: reservations up to 128 positions

    def pooled(n):  # the decoder's own, with each growth of the pool recorded
        slots, pool = Decoder.pooled_slots(dec, n)
        pool_grow = pool.grow
        pool.grow = lambda length: (grown.append((pool.capacity, length)), pool_grow(length))
        return slots, pool

    dec.pooled_slots = pooled
    try:
        assert len(list(decode_batch(dec, jobs, BatchPlan(3, FLAT, True, pooled=True, positions=128)))) == 3
    finally:
        del dec.pooled_slots
    assert grown[0] == (0, 128) and all(cap == 128 and length <= 128 for cap, length in grown[1:])


def test_a_plan_takes_its_slow_checks_from_the_record_of_an_earlier_plan(tmp_path, monkeypatch):
    """The first plan of 3 slots measures the batched-attention and prefix-reuse checks and keeps them
    in its record (no temp file left), with the row count its linears proved row-invariant over; the next
    of 3 takes them from it without running them, one of 2 slots measures its own; a record of other code,
    or unreadable, or for other forms of the linears, is measured again."""
    import dataclasses

    from knnssd.engine.model.weights import RowPadded

    dec = make_decoder(tiny("llama"))  # its own: the end changes its head's form
    record = tmp_path / "records" / "tiny.batched.json"
    ran = []
    for name in ("pooled_exact", "prefix_exact"):
        check = getattr(batch_plan, name)
        monkeypatch.setattr(batch_plan, name, lambda *a, _c=check, _n=name: (ran.append(_n), _c(*a))[1])
    rows = []
    monkeypatch.setattr(batch_plan, "rows_exact", lambda d, n, _c=batch_plan.rows_exact: (rows.append(n), _c(d, n))[1])
    first = batch_plan.plan(dec, 3, record=record)
    assert ran == ["pooled_exact", "prefix_exact"] and not first.from_record and first.exact
    max_t = dec.exactness.max_t
    (code, entry), = json.loads(record.read_text()).items()
    assert rows == [3 * max_t] and entry["rows"] == [3 * max_t]
    assert [p.name for p in record.parent.iterdir()] == [record.name]
    again = batch_plan.plan(dec, 3, record=record)
    assert again.from_record and (again.pooled, again.reuses_prefixes) == (first.pooled, first.reuses_prefixes) and len(ran) == 2
    assert again.exact and len(rows) == 1
    assert not batch_plan.plan(dec, 2, record=record).from_record and len(ran) == 4 and rows[1:] == [2 * max_t]
    assert batch_plan.plan(dec, 2, record=record).from_record and batch_plan.plan(dec, 3, record=record).from_record
    kept = json.loads(record.read_text())
    assert len(rows) == 2 and kept[code]["rows"] == [2 * max_t, 3 * max_t]
    record.write_text(json.dumps({"other": kept[code]}))
    assert not batch_plan.plan(dec, 3, record=record).from_record and len(ran) == 6 and len(rows) == 3
    record.write_text("{not json")
    assert not batch_plan.plan(dec, 3, record=record).from_record and len(ran) == 8
    record.write_text(json.dumps({code: {**kept[code], "slots": []}}))
    assert not batch_plan.plan(dec, 3, record=record).from_record and len(ran) == 10
    assert batch_plan.plan(dec, 3, record=record).from_record
    plain = dec.stack
    dec.use_stack(dataclasses.replace(dec.stack, lm_head=RowPadded(dec.stack.lm_head)))
    assert not batch_plan.plan(dec, 3, record=record).from_record and len(ran) == 12
    # the other forms' entries sit beside the first ones' (the last RECORD_CODES codes'): going back takes them
    assert len(json.loads(record.read_text())) == 2
    dec.use_stack(plain)
    assert batch_plan.plan(dec, 3, record=record).from_record and len(ran) == 12


def test_auto_slots_takes_its_choice_from_the_record(tmp_path, monkeypatch):
    """``auto_slots`` times its sizes once per record and the sizes a limit allows; the next call takes the
    choice, a call of a limit with fewer sizes (fewer jobs) times its own, and one with the same sizes takes
    it. Where the record names a size over the limit it times again."""
    dec = make_decoder(tiny("llama"))
    record = tmp_path / "tiny.batched.json"
    timed = []
    monkeypatch.setattr(batch_plan, "_auto_slots", lambda d, limit: (timed.append(limit), min(4, limit))[1])
    assert batch_plan.auto_slots(dec, 64, 8, record=record) == 4 and timed == [8]
    assert batch_plan.auto_slots(dec, 64, 8, record=record) == 4 and timed == [8]
    assert batch_plan.auto_slots(dec, 64, 2, record=record) == 2 and timed == [8, 2]
    assert batch_plan.auto_slots(dec, 64, 3, record=record) == 2 and timed == [8, 2]  # 3 jobs: the sizes of 2
    assert batch_plan.auto_slots(dec, 64, 8) == 4 and timed == [8, 2, 8]  # no record: timed
    (code, entry), = json.loads(record.read_text()).items()
    record.write_text(json.dumps({code: {**entry, "auto": {"8": 99}}}))
    assert batch_plan.auto_slots(dec, 64, 8, record=record) == 4 and timed == [8, 2, 8, 8]

def test_records_updated_by_two_writers_at_once_keep_both_writers_entries(tmp_path):
    """Two plans of other slot counts that finish together each add their entry to the same record
    (``exactness.update_record``: read, change and write under a lock on the folder); neither loses the
    other's, and no lock or temp file is left."""
    import threading
    import time

    from knnssd.engine.model import exactness

    record = tmp_path / "tiny.batched.json"

    def add(name: str) -> None:
        for i in range(20):  # the sleep between read and write loses entries without the lock
            exactness.update_record(record, lambda now, key=f"{name}{i}": (time.sleep(0.002), {**now, key: i})[1])

    writers = [threading.Thread(target=add, args=(n,)) for n in "ab"]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    assert len(json.loads(record.read_text())) == 40
    assert [p.name for p in tmp_path.iterdir()] == [record.name]


def test_a_batched_runs_pool_is_freed_when_the_run_ends_without_the_cyclic_collector():
    """A pool and its slots' caches hold no cycle: each run's buffers go with the run, by reference
    counting (with a cycle, runs in one process piled up gigabytes until the collector ran)."""
    import gc
    import weakref

    from knnssd.engine.model.cache import SlotPool

    dec = decoder("llama", "float32")
    jobs = [PromptJob(prompt_ids("llama", i, length=20), None, GenerationConfig(max_new_tokens=3)) for i in range(3)]
    pools = []
    made = SlotPool.__init__

    def record(self, *a, **kw):
        made(self, *a, **kw)
        pools.append(weakref.ref(self))

    gc.collect()
    gc.disable()
    SlotPool.__init__ = record
    try:
        assert len(list(decode_batch(dec, jobs, BatchPlan(2, FLAT, True, pooled=True, positions=64)))) == 3
        slots, pool = dec.pooled_slots(2)
        slots[0].reserve(10)
        del slots, pool
        assert len(pools) == 2 and all(r() is None for r in pools)
    finally:
        SlotPool.__init__ = made
        gc.enable()


def _anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the process's memory from Linux's /proc")
def test_a_cache_holds_memory_only_for_the_positions_written():
    """A large CPU cache buffer is mapped, not filled: reading it gives zeros and takes no memory, each
    position written takes its own, and freeing the buffer returns it (a server's pool took every slot's
    positions at its first request)."""
    from knnssd.engine.model.cache import zeros

    before = _anon_mib()
    t = zeros((16, 4, 4096, 128), torch.float32, torch.device("cpu"))  # 128 MiB
    assert t.shape == (16, 4, 4096, 128) and t.is_contiguous() and not t.any()  # every page read
    assert _anon_mib() - before < 8
    t[:, :, :512] = 1.0  # an eighth of the positions of every row: 16 MiB
    assert 12 < _anon_mib() - before < 40 and t.sum() == 16 * 4 * 512 * 128
    del t
    assert _anon_mib() - before < 8


def test_batched_greedy_is_unchanged_on_mapped_caches(monkeypatch):
    """Every cache buffer mapped (``LAZY_BYTES`` 0), a batch and each prompt's own decoding give the
    tokens they give on buffers that ``torch.zeros`` filled: a mapped page read before it is written is
    the zero page."""
    from knnssd.engine.model import cache

    dec = decoder("llama", "float32")
    plan = dataclasses.replace(batch_plan.plan(dec, slots=4), costs=PassCosts((1, 64), (0.01, 0.01)))

    def tokens(jobs: list[PromptJob]) -> list[list[int]]:
        done = {id(f.job): f.tokens for f in decode_batch(dec, jobs, plan)}
        return [done[id(j)] for j in jobs]

    filled = tokens(mixed_jobs(dec, "llama", 7, 16))
    monkeypatch.setattr(cache, "LAZY_BYTES", 0)
    jobs = mixed_jobs(dec, "llama", 7, 16)
    assert tokens(jobs) == filled
    assert [generate(dec, j.prompt_ids, None, j.config)[0] for j in jobs] == filled


def test_the_batch_thread_sees_what_it_loaded(caplog):
    """``Batcher``'s loop starts on the loaded generator: the constructor does not hand it over later."""
    from knnssd.serving.batcher import Batcher

    class Gen:
        decoder = decoder("llama", "float32")

    b = Batcher(lambda: (Gen(), BatchPlan(2, FLAT, True)))
    b.close()
    assert b.batching and not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_job_that_fails_to_start_leaves_the_others_running():
    """Issue 40's trial: one request whose start raised (a seed torch could not take) failed every request in
    the server's batch. With ``failed``, that job alone goes there, its slot freed; without it, it raises."""
    dec = decoder("llama", "float32")
    jobs = mixed_jobs(dec, "llama", 5, 8)
    bad = PromptJob([], None, GenerationConfig(max_new_tokens=4))  # prefill refuses an empty prompt
    plan = BatchPlan(2, FLAT, True, pooled=dec.attention.poolable)
    failures = []
    done = list(decode_batch(dec, [jobs[0], bad, *jobs[1:]], plan, failed=lambda job, e: failures.append((job, e))))
    assert [job for job, _ in failures] == [bad] and isinstance(failures[0][1], ValueError)
    assert sorted(id(f.job) for f in done) == sorted(id(j) for j in jobs)
    for f in done:
        assert f.tokens == generate(dec, f.job.prompt_ids, None, f.job.config)[0]
    with pytest.raises(ValueError):
        list(decode_batch(dec, [jobs[0], bad], plan))


def test_a_cancelled_job_leaves_its_slot_at_the_next_step():
    """A server's client that went away: its sequence ends at the next step (stop "cancelled") and a
    waiting job takes the slot; a job cancelled before it started goes to ``failed``. The others'
    tokens are unchanged."""
    from knnssd.engine.batch.scheduler import Cancelled, JobQueue, Scheduler

    dec = decoder("llama", "float32")
    jobs = mixed_jobs(dec, "llama", 4, 40)
    plan = BatchPlan(2, FLAT, True, pooled=dec.attention.poolable)
    queue, failures = JobQueue(), []
    for job in jobs:
        queue.put(job)
    jobs[3].cancelled = True  # never starts
    steps = []

    def on_step(runs):
        steps.append(len(runs))
        if len(steps) == 2:
            jobs[0].cancelled = True

    sched = Scheduler(dec, queue, plan, failed=lambda job, e: failures.append((job, e)), on_step=on_step)
    done = []
    for f in sched.run():
        done.append(f)
        if len(done) == 1:
            queue.close()
    assert done[0].job is jobs[0] and done[0].stats.stop == "cancelled" and len(done[0].tokens) <= 4
    assert [job for job, _ in failures] == [jobs[3]] and isinstance(failures[0][1], Cancelled)
    for f in done[1:]:
        assert f.tokens == generate(dec, f.job.prompt_ids, None, f.job.config)[0]
    assert sorted(id(f.job) for f in done) == sorted(id(j) for j in jobs[:3])


def test_generate_shows_its_plan_then_its_tokens_before_its_first_row(tmp_path, monkeypatch, capsys):
    """Trial 6: a 2,000-row ``generate`` on a loaded 2-core machine showed no row in 5:51; the batch size's
    timing alone took about 4 minutes, unseen. Its bar now says it is choosing the batch size, then the
    slots and what the plan cost (also in the summary), then the tokens made, before any row ends."""
    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.prompts import Prompt
    from knnssd.serving import batch
    from knnssd.serving.request import GenerateRequest
    from knnssd.serving.routed import RoutedGenerator
    from test_graphed_generation import bank, loaded

    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path / "cache"))  # no record: the plan is measured
    monkeypatch.setattr(batch, "PROGRESS_S", 0.0)  # every step redrawn
    gen = RoutedGenerator(loaded(), bank([DrafterConfig(kind="ngram", max_len=4)]))
    rows = [Prompt(f"p{i}", " ".join(map(str, prompt_ids("llama", i)))) for i in range(4)]
    request = GenerateRequest("tiny", str(tmp_path / "p.jsonl"), str(tmp_path / "o.parquet"),
                              GenerateParams(max_new_tokens=16), batch_size=2)
    summary = batch.run(request, gen, rows)
    shown = [x for x in capsys.readouterr().err.replace("\r", "\n").splitlines() if x.startswith("generate:")]
    first_row = next(i for i, x in enumerate(shown) if " 1/4 " in x)
    before = shown[:first_row]
    assert any("choosing the batch size" in x for x in before), shown
    assert any("2 slots, planned in " in x and " tokens]" in x for x in before), shown
    assert summary.rows == 4 and summary.batch_size == 2 and summary.plan_s > 0
