"""The 37k output projection summarized as a beam-4 search asks (8 best, the log-softmax's terms), one thread, its
weights from memory (two 19 MB copies called in turn), at 32 rows (8 sentences' beams) and 128 (32 sentences'): the
best of 15 calls, in ms.

    PYTHONPATH=<a build's checkout> python projection_k8_from_memory.py
"""

import timeit

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
ext = extension()
generator = torch.Generator().manual_seed(0)
projections = [ext.PackedLinear(torch.randn(37000, 512, generator=generator) * 512 ** -0.5, torch.zeros(37000), 8,
                                "int8", True) for _ in range(2)]
cells = []
for rows in (32, 128):
    x = torch.randn(rows, 512, generator=generator)
    seconds = min(timeit.repeat(lambda: [p.summarize(x, 8, [0, 1], log_totals=True) for p in projections], number=1,
                                repeat=15)) / 2
    cells.append(f"{rows} rows {seconds * 1e3:.3f} ms")
print(", ".join(cells))
