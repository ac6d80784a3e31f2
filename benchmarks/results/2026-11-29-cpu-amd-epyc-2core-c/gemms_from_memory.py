"""The int8 GEMMs of a decoding step with their weights read from memory, one thread, at 1 to 128 rows: the 37k
output projection's summary (the argmax, as a greedy search asks; two copies called in turn, 19 MB each) and six
decoder layers' GEMMs in turn (22 MB); the best of 10 calls, in ms.

    PYTHONPATH=<a build's checkout> python gemms_from_memory.py
"""

import timeit

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
ext = extension()
generator = torch.Generator().manual_seed(0)
ROWS = (1, 4, 6, 8, 12, 32, 128)
LAYER_SHAPES = [(1536, 512), (512, 512), (512, 512), (512, 512), (2048, 512), (512, 2048)] * 6


def linear(out: int, inp: int, rows: int):
    weight = torch.randn(out, inp, generator=generator) * inp ** -0.5
    return ext.PackedLinear(weight, torch.zeros(out), rows, "int8", True)


projections = [linear(37000, 512, 8) for _ in range(2)]
cells = []
for rows in ROWS:
    x = torch.randn(rows, 512, generator=generator)
    seconds = min(timeit.repeat(lambda: [p.summarize(x, 1, [0, 1]) for p in projections], number=1, repeat=10)) / 2
    cells.append(f"{rows}: {seconds * 1e3:.3f}")
print("output projection, rows: ms | " + ", ".join(cells))
cells = []
for rows in ROWS:
    layers = [(linear(out, inp, rows), torch.randn(rows, inp, generator=generator)) for out, inp in LAYER_SHAPES]
    seconds = min(timeit.repeat(lambda: [layer(x) for layer, x in layers], number=1, repeat=10))
    cells.append(f"{rows}: {seconds * 1e3:.2f}")
print("six decoder layers, rows: ms | " + ", ".join(cells))
