"""One decoding step's GEMMs at a few rows (1: a sentence's greedy search, 4: its beam 4, 8), six decoder layers'
(qkv, self-attention out, cross-attention query and out, feed-forward in and out), and in int8 the 37k output
projection's summary too: 41 MB of int8 weights, 88 MB of float32 ones (the layers'), that come from memory at
every step (they pass through the 32 MB L3). The best of 20 steps, and the weights' bytes over that time. float32
takes fastformer's own GEMM (float32_gemm.h) where the CPU loops are AVX2's: run it with FASTFORMER_CPU_ISA=avx2.

    PYTHONPATH=<a build's checkout> python step_gemms_few_rows.py THREADS COMPUTE_TYPE
"""

import sys
import timeit

import torch

from fastformer.decoding.compiled import extension

threads, compute_type = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(threads)
ext = extension()
generator = torch.Generator().manual_seed(0)
LAYER_SHAPES = [(1536, 512), (512, 512), (512, 512), (512, 512), (2048, 512), (512, 2048)] * 6


def linear(out: int, inp: int, rows: int):
    weight = torch.randn(out, inp, generator=generator) * inp ** -0.5
    return ext.PackedLinear(weight, torch.zeros(out), rows, compute_type)


for rows in (1, 4, 8):
    layers = [(linear(out, inp, rows), torch.randn(rows, inp, generator=generator)) for out, inp in LAYER_SHAPES]
    weights = sum(out * inp for out, inp in LAYER_SHAPES)
    calls = [lambda layer=layer, x=x: layer(x) for layer, x in layers]
    if compute_type == "int8":
        projection, x = linear(37000, 512, rows), torch.randn(rows, 512, generator=generator)
        calls.append(lambda: projection.summarize(x, 1, [0, 1]))
        weights += 37000 * 512

    def step() -> None:
        for call in calls:
            call()

    step()
    seconds = min(timeit.repeat(step, number=1, repeat=20))
    weight_bytes = weights * (1 if compute_type == "int8" else 4)
    print(f"{layers[0][0].route}, threads={threads}, rows={rows}: step GEMMs {seconds * 1e3:.3f} ms, "
          f"{weight_bytes / 1e6:.0f} MB of weights -> {weight_bytes / seconds / 1e9:.1f} GB/s")
