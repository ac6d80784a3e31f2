"""The int8 37k output projection's summary (PackedLinear.summarize) by what it keeps, one thread, in turn call by
call: nothing (k=0), top-1 (greedy search), top-10 (top-10 sampling), top-8 with the log-softmax terms (beam 4).
Random weights, two copies called in turn so that they come from memory; 32 and 64 rows of random inputs; 40
rounds; each mode's median in ms.

    OMP_NUM_THREADS=1 python summary_by_k.py
"""

import statistics
import time

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
generator = torch.Generator().manual_seed(0)
projections = [extension().PackedLinear(torch.randn(37000, 512, generator=generator) * 512 ** -0.5,
                                        torch.zeros(37000), 8, "int8", True) for _ in range(2)]
modes = {"nothing": (0, False), "top-1": (1, False), "top-10": (10, False), "top-8 and log terms": (8, True)}
for rows in (32, 64):
    x = torch.randn(rows, 512, generator=generator)
    ms = {name: [] for name in modes}
    for _ in range(40):
        for name, (k, log_totals) in modes.items():
            start = time.perf_counter()
            for projection in projections:
                projection.summarize(x, k, [0, 1], log_totals=log_totals)
            ms[name].append((time.perf_counter() - start) / len(projections) * 1e3)
    print(f"{rows} rows: " + ", ".join(f"{name} {statistics.median(v):.3f} ms" for name, v in ms.items()), flush=True)
