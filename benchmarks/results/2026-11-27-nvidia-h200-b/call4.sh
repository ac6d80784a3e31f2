#!/usr/bin/env bash
# Fourth call: gemm_rows.py under the settings of call 3.
REPO=$(pwd)
for config in "" "FASTFORMER_CPU_ISA=avx2" "ONEDNN_MAX_CPU_ISA=AVX2"; do
    echo "== [${config:-default}]"
    (cd "$OUT" && env $config timeout 60 python3 "$REPO/benchmarks/results/2026-11-27-nvidia-h200-b/gemm_rows.py" 2>&1)
done | tee "$OUT/gemm_rows.log"
