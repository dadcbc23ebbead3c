"""GGUF blocks (``engine/model/quantized.py``): a file's header read once until the file changes."""


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
