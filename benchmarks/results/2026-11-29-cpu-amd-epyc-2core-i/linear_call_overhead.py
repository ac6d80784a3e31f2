"""What a float32 PackedLinear call costs beyond its multiply-adds: one thread, a 16 x 16 layer on one row (next to
nothing to compute) and the decoder's 512 x 512 layer on 128 rows (a two-thread headline group's step), 2,000 calls
five times after 200 -> the route and microseconds a call (the fastest and the median of the five).

    OMP_NUM_THREADS=1 python linear_call_overhead.py                           # oneDNN's route on AVX-512
    OMP_NUM_THREADS=1 FASTFORMER_CPU_ISA=avx2 python linear_call_overhead.py   # the own float32 GEMM's
"""
import statistics
import time

import torch

from fastformer import _C

torch.set_num_threads(1)
for out, inp, rows in [(16, 16, 1), (512, 512, 128)]:
    layer = _C.PackedLinear(torch.randn(out, inp), torch.zeros(out), rows, "float32", True)
    x = torch.randn(rows, inp)
    for _ in range(200):
        layer(x)
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            layer(x)
        seconds.append((time.perf_counter() - start) / 2000)
    print(f"{layer.route} {rows} x {inp} -> {out}: {min(seconds) * 1e6:.2f} us a call (median "
          f"{statistics.median(seconds) * 1e6:.2f})", flush=True)
