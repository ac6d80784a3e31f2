"""The int8 output projection on FBGEMM's GEMM (the base model's 37k-vocabulary layer at 128 rows, a headline group's
step) on one thread, best of 15 calls, the way fastformer runs it where its own int8 GEMM does not (FASTFORMER_CPU_ISA
below avx512): run it with and without FBGEMM_ENABLE_INSTRUCTIONS=AVX2 to see whether FBGEMM's kernels were capped.

    FASTFORMER_CPU_ISA=avx2 python fbgemm_cap.py
    FASTFORMER_CPU_ISA=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 python fbgemm_cap.py
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from fastformer.decoding.compiled import extension


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    vocab, d_model, rows = 37000, 512, 128
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, d_model, generator=generator) * d_model ** -0.5
    x = torch.randn(rows, d_model, generator=generator)
    layer = extension().PackedLinear(weight, torch.zeros(vocab), rows, "int8")
    checksum = float(layer(x).sum())
    seconds = []
    for _ in range(args.calls):
        start = time.perf_counter()
        layer(x)
        seconds.append(time.perf_counter() - start)
    print(f"FASTFORMER_CPU_ISA={os.environ.get('FASTFORMER_CPU_ISA')} "
          f"FBGEMM_ENABLE_INSTRUCTIONS={os.environ.get('FBGEMM_ENABLE_INSTRUCTIONS')} route={layer.route} "
          f"best={min(seconds) * 1e3:.2f} ms ({2 * rows * vocab * d_model / min(seconds) / 2e9:.1f} G multiply-adds/s) "
          f"checksum={checksum:.4f}")


if __name__ == "__main__":
    main()
