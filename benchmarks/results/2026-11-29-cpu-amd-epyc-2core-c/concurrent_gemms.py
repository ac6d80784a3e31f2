"""One int8 GEMM (128 rows x 512 inputs -> OUT outputs) called again and again on one thread: its multiply-adds a
second, the best of 5 runs. Run alone, then two processes at once (one a core), to see whether both cores busy slow
a GEMM down: OUT 1024 keeps its weights in L2; OUT 37000 (19 MB a process, 38 MB for two) reads them from L3 and
memory.

    PYTHONPATH=<a build's checkout> python concurrent_gemms.py OUT CALLS
    (PYTHONPATH=... python concurrent_gemms.py OUT CALLS & PYTHONPATH=... python concurrent_gemms.py OUT CALLS; wait)
"""

import sys
import time

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
out, calls, rows = int(sys.argv[1]), int(sys.argv[2]), 128
generator = torch.Generator().manual_seed(0)
layer = extension().PackedLinear(torch.randn(out, 512, generator=generator) * 512 ** -0.5, torch.zeros(out), rows,
                                 "int8", True)
x = torch.randn(rows, 512, generator=generator)
for _ in range(calls // 10):
    layer(x)
best = float("inf")
for _ in range(5):
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    best = min(best, time.perf_counter() - start)
print(f"out={out}: {rows * 512 * out * calls / best / 1e9:.1f} G multiply-adds/s")
