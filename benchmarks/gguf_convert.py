"""A GGUF file's first conversion (``conversion.convert_gguf``) with and without ``shims.gguf_parsed_once``.

Each round converts the embedded model into an empty cache twice, as transformers reads the file and with
the shim, in turns, and checks that the two folders' weights are bitwise equal and their tokenizer and
config files byte for byte.

    .venv/bin/python benchmarks/gguf_convert.py [--model smollm2] [--rounds 2]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file

from knnssd import conversion, shims
from knnssd.bench import options


def convert(name: str, parsed_once: bool) -> tuple[float, tuple]:
    gguf = conversion.embedded_gguf(name)  # Gemma's parts are joined into the knnssd cache: not timed
    cache = tempfile.mkdtemp(prefix="knnssd-convert-")
    saved, before = shims.gguf_parsed_once, os.environ.get("KNNSSD_CACHE")
    os.environ["KNNSSD_CACHE"] = cache  # settings.cache_dir() reads it at each call
    if not parsed_once:
        shims.gguf_parsed_once = lambda: contextlib.nullcontext(False)
    try:
        t = time.perf_counter()
        folder = conversion.convert_gguf(gguf, name)
        secs = time.perf_counter() - t
        return secs, (load_file(folder / "model.safetensors"), (folder / "tokenizer.json").read_bytes(),
                      (folder / "config.json").read_bytes())
    finally:
        shims.gguf_parsed_once = saved
        if before is None:
            del os.environ["KNNSSD_CACHE"]
        else:
            os.environ["KNNSSD_CACHE"] = before
        shutil.rmtree(cache, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.model(ap, choices=sorted(conversion.EMBEDDED))
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    secs: dict[bool, list[float]] = {False: [], True: []}
    out = {}
    for _ in range(a.rounds):
        for once in (False, True):
            s, out[once] = convert(a.model, once)
            secs[once].append(s)
    (w0, tok0, cfg0), (w1, tok1, cfg1) = out[False], out[True]
    same = w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    plain, once = statistics.median(secs[False]), statistics.median(secs[True])
    print(f"{a.model}: as transformers reads it {plain:.2f} s, parsed once {once:.2f} s ({once / plain:.2f}x); "
          f"weights bitwise equal: {same}, tokenizer.json equal: {tok0 == tok1}, config.json equal: {cfg0 == cfg1}")


if __name__ == "__main__":
    main()
