"""ggml's CPU matrix products beside knnssd's native linears: are ggml's rows row-invariant, and which is faster?

    .venv/bin/python benchmarks/ggml_rows.py

knnssd's exactness needs each row of a linear to come out with the same bits whatever the call's row count
(docs/exactness.md). ggml (llama.cpp's kernel library) covers every instruction set knnssd targets, so the
issue of every CPU asked whether to adopt it. This compiles a small C program against the ggml that
``llama_cpp_peer.py`` builds (``$KNNSSD_CACHE/llama.cpp/<version>``) and, for each weight type
(BF16, Q4_1, Q8_0) on SmolLM2's shapes, runs ``ggml_mul_mat`` over the first M rows of one random input for
M = 1, 2, 4, 8, 16, 64, 256 and prints how many of those rows differ from the same row computed alone
(M = 1), and the time of one call (best of 5, 2 threads). knnssd's ``native.Linear`` runs the same shapes
(its weights quantized by knnssd, so the values differ from ggml's; the times compare), and for BF16 so does
torch's oneDNN GEMM on its prepacked weights (``weights.PackedLinear``, what knnssd ran before its own kernel; on a
CPU with AMX, oneDNN's tile kernels: the comparison that decides whether AMX machines should leave the native
linears, ``native_library.linear_preferred``).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_peer  # noqa: E402  (the llama.cpp build)

from knnssd.bench import markdown as md  # noqa: E402
from knnssd.engine.model import native, native_library  # noqa: E402
from knnssd.engine.model.quantized import quantize  # noqa: E402
from knnssd.engine.model.weights import PackedLinear  # noqa: E402

SHAPES = ((960, 576), (3072, 576), (576, 1536))  # SmolLM2's fused qkv, gate/up and down: (N outputs, K inputs)
ROWS = (1, 2, 4, 8, 16, 64, 256)
THREADS = 2

PROGRAM = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

int main(int argc, char **argv) {
    enum ggml_type type = (enum ggml_type)atoi(argv[1]);
    int N = atoi(argv[2]), K = atoi(argv[3]), threads = atoi(argv[4]);
    int rows[] = {1, 2, 4, 8, 16, 64, 256}, nr = sizeof rows / sizeof *rows, Mmax = 256;
    struct ggml_init_params p = {(size_t)1 << 31, NULL, false};
    struct ggml_context *ctx = ggml_init(p);
    ggml_cpu_init();
    float *wf = malloc(sizeof(float) * N * K), *xf = malloc(sizeof(float) * Mmax * K);
    srand(1);
    for (long i = 0; i < (long)N * K; i++) wf[i] = ((float)rand() / RAND_MAX - 0.5f) * 0.1f;
    for (long i = 0; i < (long)Mmax * K; i++) xf[i] = ((float)rand() / RAND_MAX - 0.5f) * 4.0f;
    struct ggml_tensor *w = ggml_new_tensor_2d(ctx, type, K, N);
    ggml_quantize_chunk(type, wf, w->data, 0, N, K, NULL);
    float *alone = malloc(sizeof(float) * Mmax * N);
    for (int r = 0; r < nr; r++) {
        int M = rows[r];
        struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, M);
        memcpy(x->data, xf, sizeof(float) * M * K);
        struct ggml_tensor *y = ggml_mul_mat(ctx, w, x);
        struct ggml_cgraph *g = ggml_new_graph(ctx);
        ggml_build_forward_expand(g, y);
        if (M == 1) {  /* each row alone: Mmax calls of one row, then row 0 back for the timed calls */
            for (int m = 0; m < Mmax; m++) {
                memcpy(x->data, xf + (long)m * K, sizeof(float) * K);
                ggml_graph_compute_with_ctx(ctx, g, threads);
                memcpy(alone + (long)m * N, y->data, sizeof(float) * N);
            }
            memcpy(x->data, xf, sizeof(float) * K);
        }
        double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = now();
            ggml_graph_compute_with_ctx(ctx, g, threads);
            double t = now() - t0;
            best = t < best ? t : best;
        }
        int differ = 0;
        for (int m = 0; m < M; m++) differ += memcmp((float *)y->data + (long)m * N, alone + (long)m * N, sizeof(float) * N) != 0;
        printf("%d %d %.1f\n", M, differ, best * 1e6);
    }
    return 0;
}
"""

TYPES = {"BF16": 30, "Q4_1": 3, "Q8_0": 8}  # ggml_type's values


def build(bin_dir: Path, folder: Path) -> Path:
    src = bin_dir.parents[1]  # .../src: llama.cpp's source tree, build/bin below it
    (folder / "rows.c").write_text(PROGRAM)
    exe = folder / "rows"
    subprocess.run(["cc", "-O2", str(folder / "rows.c"), "-o", str(exe), f"-I{src / 'ggml' / 'include'}",
                    f"-L{bin_dir}", f"-Wl,-rpath,{bin_dir}", "-lggml", "-lggml-base", "-lggml-cpu", "-lm"],
                   check=True, capture_output=True, text=True)
    return exe


def ggml_rows(exe: Path, kind: str, N: int, K: int) -> dict[int, tuple[int, float]]:
    out = subprocess.run([str(exe), str(TYPES[kind]), str(N), str(K), str(THREADS)], check=True,
                         capture_output=True, text=True).stdout
    return {int(m): (int(d), float(us)) for m, d, us in (line.split() for line in out.splitlines())}


def own_rows(kind: str, N: int, K: int, onednn: bool = False) -> dict[int, tuple[int, float]]:
    """knnssd's kernel (or, ``onednn``, oneDNN's bf16 GEMM) on the shape: per row count, (rows unlike alone, us)."""
    g = torch.Generator().manual_seed(1)
    w = ((torch.rand(N, K, generator=g) - 0.5) * 0.1).to(torch.bfloat16)
    if onednn:
        lin = PackedLinear(torch.ops.mkldnn._reorder_linear_weight(w, 16), None) if kind == "BF16" else None
    else:
        lin = {"BF16": lambda: native.Linear.of(w, None), "Q4_1": lambda: native.Linear.q4(*quantize(w, "q4_1"), None),
               "Q8_0": lambda: native.Linear.q8(*quantize(w, "q8_0"), None)}[kind]()
    if lin is None:
        return {}
    x = ((torch.rand(256, K, generator=g) - 0.5) * 4).to(torch.bfloat16)
    alone = torch.cat([lin(x[m : m + 1]) for m in range(256)])
    out = {}
    for M in ROWS:
        lin(x[:M])
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            y = lin(x[:M])
            times.append(time.perf_counter() - t0)
        out[M] = (int((y != alone[:M]).any(-1).sum()), min(times) * 1e6)
    return out


def main() -> None:
    torch.set_num_threads(THREADS)
    bin_dir = llama_cpp_peer.build()
    print(f"{llama_cpp_peer._cpu()}, {THREADS} threads; knnssd kernels: {native_library.kernel_path()}")
    print("\n".join(md.head(["weights", "N x K", "rows", "ggml rows unlike alone", "ggml us",
                             "knnssd rows unlike alone", "knnssd us", "oneDNN rows unlike alone", "oneDNN us"],
                            "llrrrrrrr")))
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(bin_dir, Path(tmp))
        for kind in TYPES:
            for N, K in SHAPES:
                theirs, mine, dnn = ggml_rows(exe, kind, N, K), own_rows(kind, N, K), own_rows(kind, N, K, onednn=True)
                for M in ROWS:
                    d, us = theirs[M]
                    od, ous = mine.get(M, ("-", float("nan")))
                    nd, nus = dnn.get(M, ("-", float("nan")))
                    print(md.row([kind, f"{N} x {K}", M, d, f"{us:.0f}", od, f"{ous:.0f}", nd, f"{nus:.0f}"]))


if __name__ == "__main__":
    main()
