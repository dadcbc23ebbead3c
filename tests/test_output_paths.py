"""An output's paths (``serving/output_paths.py``): never the input, always a regular .parquet file, one writer."""
import os
import signal
from pathlib import Path

import pytest

from knnssd.serving import output_paths
from cli_cases import hold_output


def test_an_output_that_is_the_input_is_refused_even_with_overwrite(tmp_path):
    """Defect 2: ``--input x.parquet --output x.parquet --overwrite`` replaced the prompts with the answers.
    The same path, a symbolic link and a hard link are all refused, as are the output's journal and lock."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = tmp_path / "x.parquet"
    pq.write_table(pa.table({"prompt": ["hello"]}), inp)
    before = inp.read_bytes()
    (tmp_path / "link.parquet").symlink_to(inp)
    os.link(inp, tmp_path / "hard.parquet")
    for out in (inp, tmp_path / "." / "x.parquet", tmp_path / "link.parquet", tmp_path / "hard.parquet"):
        with pytest.raises(output_paths.OutputError, match="is the input file .*choose another path, such as"):
            output_paths.check_paths(out, [str(inp)])
    journal = tmp_path / "y.parquet.progress.jsonl"
    journal.write_text('{"prompt": "hi"}\n')
    with pytest.raises(output_paths.OutputError, match="is the input file"):
        output_paths.check_paths(tmp_path / "y.parquet", [journal])
    assert inp.read_bytes() == before
    output_paths.check_paths(tmp_path / "other.parquet", [inp])


def test_outputs_that_are_not_parquet_files_are_refused(tmp_path):
    """The trial after issue 40: ``--output /dev/null`` got "not a parquet file (FileNotFoundError) ... pass
    --overwrite", and ``--overwrite`` then replaced a device node; ``o.csv`` got parquet silently."""
    fifo = tmp_path / "pipe.parquet"
    os.mkfifo(fifo)
    for out, message in ((Path("/dev/null"), "is not a regular file"), (fifo, "is not a regular file"),
                         (tmp_path / "o.csv", "does not name a .parquet file"),
                         (tmp_path / "trail", "does not name a .parquet file")):
        with pytest.raises(output_paths.OutputError, match=message):
            output_paths.check_paths(out)
    link = tmp_path / "link.parquet"
    link.symlink_to(tmp_path / "real.parquet")
    assert output_paths.output_path(link) == tmp_path / "real.parquet"  # written through the link, not over it
    output_paths.check_paths(tmp_path / "o.pq")


def test_one_writer_per_output_and_sigkill_releases_it(tmp_path):
    out = tmp_path / "out.parquet"
    holder = hold_output(out)
    try:
        with pytest.raises(output_paths.OutputError, match=f"being written by process {holder.pid}"):
            with output_paths.writing(out):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with output_paths.writing(out):  # the kernel released the flock with the killed holder
        with output_paths.writing(out):  # re-entrant within one process (the CLI holds it around the flow)
            pass
    assert not output_paths.lock_path(out).exists()
