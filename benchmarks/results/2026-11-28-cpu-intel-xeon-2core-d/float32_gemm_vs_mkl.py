"""fastformer's own float32 GEMM (route avx2-float32) against MKL's sgemm (torch.nn.functional.linear, what
CTranslate2's float32 runs on this CPU), call by call in turn, at the base model's shapes: rows x inputs -> outputs,
the medians in G multiply-adds/s and MKL's time over the own GEMM's per pair (median). Capped to AVX2:

    FASTFORMER_CPU_ISA=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 \
        python float32_gemm_vs_mkl.py THREADS PAIRS
"""
import statistics
import sys
import time

import torch

from fastformer.decoding.compiled import extension

# 64 rows: greedy search of 64 sentences (a decoder step); 256: beam 4; 1280: the encoder at 20-token sources.
SHAPES = [(64, 512, 37000), (64, 512, 512), (64, 512, 1536), (64, 512, 2048), (64, 2048, 512), (256, 512, 37000),
          (256, 512, 2048), (256, 2048, 512), (1280, 512, 512), (1280, 512, 2048), (1280, 2048, 512)]

torch.set_num_threads(int(sys.argv[1]))
pairs = int(sys.argv[2])
print(f"cpu_isa {extension().cpu_isa()}, threads {torch.get_num_threads()}, pairs {pairs}")
for rows, n_in, n_out in SHAPES:
    x, weight, bias = torch.rand(rows, n_in) - 0.5, torch.rand(n_out, n_in) - 0.5, torch.rand(n_out)
    own = extension().PackedLinear(weight, bias, rows, "float32")
    assert own.route == "avx2-float32", own.route
    routes = {"own": own, "mkl": lambda x: torch.nn.functional.linear(x, weight, bias)}
    difference = (routes["own"](x) - routes["mkl"](x)).abs().max().item()
    times = {name: [] for name in routes}
    for _ in range(pairs):
        for name, route in routes.items():
            start = time.perf_counter()
            route(x)
            times[name].append(time.perf_counter() - start)
    ratio = statistics.median(m / o for o, m in zip(times["own"], times["mkl"]))
    rate = {name: rows * n_in * n_out / statistics.median(t) / 1e9 for name, t in times.items()}
    print(f"{rows:5d} x {n_in:4d} -> {n_out:5d}: own {rate['own']:5.1f}, MKL {rate['mkl']:5.1f} G/s; MKL / own time "
          f"{ratio:.2f}; largest difference {difference:.1e}", flush=True)
