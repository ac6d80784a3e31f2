"""The int8 GEMM (AVX512-VNNI tiles) at the search's shapes with its weights read from memory, as in the search,
where the decoder's 41 MB of int8 weights pass through the 32 MB L3 every step; one thread, the best of each call's
runs, in milliseconds.

    OMP_NUM_THREADS=1 PYTHONPATH=<a build's checkout> python gemm_weights_from_memory.py

- the output projection (512 -> 37000) at 128 and 256 rows (beam 4 of 32 and 64 sentences), summarized as the beam
  search asks (8 best), called again and again (its weights in cache) and three copies in turn (from memory);
- six decoder layers' GEMMs in turn (qkv, self-attention out, cross-attention query and out, feed-forward in and out).
"""

import timeit

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
ext = extension()
generator = torch.Generator().manual_seed(0)


def linear(out: int, inp: int, rows: int):
    weight = torch.randn(out, inp, generator=generator) * inp ** -0.5
    return ext.PackedLinear(weight, torch.zeros(out), rows, "int8", True)


def best_ms(call, n: int) -> float:
    call()
    return min(timeit.repeat(call, number=1, repeat=n)) * 1e3


for rows in (128, 256):
    projections = [linear(37000, 512, rows) for _ in range(3)]
    x = torch.randn(rows, 512, generator=generator)
    in_cache = best_ms(lambda: projections[0].summarize(x, 8, [0, 1]), 15)
    from_memory = best_ms(lambda: [p.summarize(x, 8, [0, 1]) for p in projections], 15) / 3
    print(f"512 -> 37000, {rows} rows: in cache {in_cache:.3f} ms, from memory {from_memory:.3f} ms")
for rows in (32, 128, 256):
    shapes = [(1536, 512), (512, 512), (512, 512), (512, 512), (2048, 512), (512, 2048)] * 6
    layers = [(linear(out, inp, rows), torch.randn(rows, inp, generator=generator)) for out, inp in shapes]
    print(f"six decoder layers' GEMMs in turn, {rows} rows: "
          f"{best_ms(lambda: [layer(x) for layer, x in layers], 10):.3f} ms")
