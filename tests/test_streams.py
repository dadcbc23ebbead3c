"""The drafting scripts' streams (``bench/streams.py``): options read or refused in one line, and tables."""
import pytest


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
