"""python row_tiles_bench.py ROWS...: the int8 GEMM of the imported fastformer (its in-place build or an installed
one, by PYTHONPATH) at the base model's shapes, one thread: each layer's best of 40 calls in microseconds, one line a
row count. The search's shapes: 512 -> 1,536 (self-attention's qkv), 512 -> 2,048 and 2,048 -> 512 (the
feed-forward), and the 37k output projection summarized as greedy search (k 1) and beam search (k 8 with log-softmax
terms) take it. Which GEMM runs: FASTFORMER_CPU_ISA, FASTFORMER_CPU_VNNI and FASTFORMER_CPU_AMX as the caller sets."""

import sys
import time

import torch

import fastformer._C as extension

torch.set_num_threads(1)
generator = torch.Generator().manual_seed(0)
SHAPES = {"qkv": (512, 1536), "ffn1": (512, 2048), "ffn2": (2048, 512), "vocab": (512, 37000)}
layers = {name: extension.PackedLinear(torch.randn(out, d_in, generator=generator) * d_in ** -0.5, torch.zeros(out),
                                       64, "int8") for name, (d_in, out) in SHAPES.items()}


def best_us(call, n: int = 40) -> float:
    call()
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


print("route", layers["qkv"].route, "file", extension.__file__)
for rows in map(int, sys.argv[1:]):
    x = {name: torch.randn(rows, d_in, generator=generator) for name, (d_in, _) in SHAPES.items()}
    times = {name: best_us(lambda: layers[name](x[name])) for name in ("qkv", "ffn1", "ffn2")}
    times["vocab k1"] = best_us(lambda: layers["vocab"].summarize(x["vocab"], 1), 10)
    times["vocab k8+lse"] = best_us(lambda: layers["vocab"].summarize(x["vocab"], 8, log_totals=True), 10)
    print(f"rows {rows}: " + ", ".join(f"{name} {us:.0f}" for name, us in times.items()), flush=True)
