"""`knnssd bench` (``bench/bank.py``): its throughput table kept until its settings change."""
import dataclasses


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
