"""fastformer's own int8 GEMM against FBGEMM's, one layer at a time, one thread, in this process's instruction sets:
the base model's shapes (the encoder's 1344 rows, a headline group's 128, one sentence's beams, the 37k-vocabulary
output projection), each layer converted both ways from the same weights, best of 3 timings of >= 2 G multiply-adds.

    FASTFORMER_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
        python own_int8_gemm.py

The error column is each route's largest distance from the float32 product, for scale (both quantize the rows to
int8_activation_max() steps a side).
"""
import time

import torch

from fastformer.decoding.compiled import extension

SHAPES = [(128, 512, 37000), (4, 512, 37000), (128, 512, 2048), (128, 2048, 512), (1344, 512, 2048), (256, 512, 1536)]


def best_seconds(layer, x: torch.Tensor, calls: int) -> float:
    for _ in range(3):
        layer(x)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            layer(x)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    torch.set_num_threads(1)
    ext = extension()
    print(f"cpu_isa={ext.cpu_isa()} int8_activation_max={ext.int8_activation_max()}")
    generator = torch.Generator().manual_seed(0)
    for rows, inputs, outputs in SHAPES:
        weight = torch.randn(outputs, inputs, generator=generator) * 0.05
        bias = torch.randn(outputs, generator=generator)
        x = torch.randn(rows, inputs, generator=generator)
        exact = x @ weight.T + bias
        multiply_adds = rows * inputs * outputs
        timed = {}
        for name, options in (("own", {}), ("fbgemm", {"own_gemm": False})):
            layer = ext.PackedLinear(weight, bias, rows, "int8", **options)
            seconds = best_seconds(layer, x, max(3, int(2e9 / multiply_adds)))
            timed[name] = (layer.route, seconds, (layer(x) - exact).abs().max().item())
        cells = [f"{route} {seconds * 1e3:.2f} ms ({multiply_adds / seconds / 1e9:.0f} G/s, error {error:.3f})"
                 for route, seconds, error in timed.values()]
        print(f"{rows} rows x {inputs} -> {outputs}: {', '.join(cells)}; "
              f"own {timed['fbgemm'][1] / timed['own'][1]:.2f}x FBGEMM's speed")


if __name__ == "__main__":
    main()
