"""fastformer's own AVX-512 float32 GEMM (route avx512-float32) against oneDNN's (PackedLinear(own_gemm=False)) at
the base model's shapes, call by call in turn (which goes first alternating), 7 rounds of enough calls for ~2e8
multiply-adds each -> each one's G multiply-adds/s (median) and the own one's time over oneDNN's. Each output is first
checked against a float64 product.

    python float32_gemm_vs_onednn.py THREADS
"""
import statistics
import sys
import time

import torch

from fastformer.decoding import compiled

ext = compiled.extension()
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
shapes = [(512, 512), (512, 2048), (2048, 512), (512, 37000)]
for rows in (4, 32, 128, 256, 1344):
    for in_f, out_f in shapes:
        if rows == 1344 and out_f == 37000:
            continue
        w = torch.randn(out_f, in_f) / in_f ** 0.5
        b = torch.randn(out_f)
        own = ext.PackedLinear(w, b, rows, "float32")
        dnn = ext.PackedLinear(w, b, rows, "float32", own_gemm=False)
        assert own.route == "avx512-float32" and dnn.route == "onednn", (own.route, dnn.route)
        x = torch.randn(rows, in_f)
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
        assert torch.allclose(own(x), ref, atol=1e-4, rtol=1e-4)
        reps = max(1, int(2e8 / (rows * in_f * out_f)))
        times = {"own": [], "dnn": []}
        for r in range(7):
            for name, lin in (("own", own), ("dnn", dnn)) if r % 2 else (("dnn", dnn), ("own", own)):
                t = time.perf_counter()
                for _ in range(reps):
                    lin(x)
                times[name].append((time.perf_counter() - t) / reps)
        o, d = statistics.median(times["own"]), statistics.median(times["dnn"])
        macs = rows * in_f * out_f
        print(f"rows {rows:5d} {in_f:5d}->{out_f:6d}: own {macs / o / 1e9:6.1f} G/s  onednn {macs / d / 1e9:6.1f} G/s  "
              f"own/onednn time {o / d:.3f}", flush=True)
