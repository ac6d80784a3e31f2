"""fastformer's own float32 GEMM (avx2-float32) against oneDNN's (PackedLinear(own_gemm=False)) at the base model's
shapes, in one process, call by call in turn: rows, inputs, outputs -> the medians in G multiply-adds/s and oneDNN's
time over the own GEMM's per pair (median and quartiles). Run capped: FASTFORMER_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2;
argument: the threads."""

import statistics
import sys
import time

import torch

from fastformer.decoding.compiled import extension

SHAPES = [(4, 512, 37000), (32, 512, 37000), (32, 512, 512), (32, 512, 2048), (32, 2048, 512), (128, 512, 37000),
          (128, 512, 2048), (128, 2048, 512), (1344, 512, 2048), (1344, 2048, 512)]
PAIRS = 30

torch.set_num_threads(int(sys.argv[1]))
print(f"cpu_isa {extension().cpu_isa()}, threads {torch.get_num_threads()}")
for rows, in_features, out_features in SHAPES:
    x, weight, bias = torch.rand(rows, in_features) - 0.5, torch.rand(out_features, in_features) - 0.5, torch.rand(out_features)
    own = extension().PackedLinear(weight, bias, rows, "float32")
    onednn = extension().PackedLinear(weight, bias, rows, "float32", own_gemm=False)
    assert (own.route, onednn.route) == ("avx2-float32", "onednn"), (own.route, onednn.route)
    times = {own: [], onednn: []}
    for _ in range(PAIRS):
        for linear in (own, onednn):
            start = time.perf_counter()
            linear(x)
            times[linear].append(time.perf_counter() - start)
    ratios = [b / a for a, b in zip(times[own], times[onednn])]
    low, _, high = statistics.quantiles(ratios, n=4)
    rate = {linear: rows * in_features * out_features / statistics.median(t) / 1e9 for linear, t in times.items()}
    print(f"rows {rows:5d} in {in_features:5d} out {out_features:6d}: own {rate[own]:5.1f}, oneDNN {rate[onednn]:5.1f} "
          f"G/s; oneDNN / own time {statistics.median(ratios):.2f} ({low:.2f}-{high:.2f})")
