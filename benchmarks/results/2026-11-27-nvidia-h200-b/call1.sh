#!/usr/bin/env bash
# One device call: issue 33's A/B of the training step against 0097ec4 (the commit before the issue), then the
# GPU-marked tests of this commit. Run from the repository root with OUT set and a copy of 0097ec4's tree in
# ab-baseline-0097ec4/ (git archive 0097ec4 | tar -x -C ab-baseline-0097ec4):
#     OUT=DIR bash benchmarks/results/2026-11-27-nvidia-h200-b/call1.sh COMMIT
set -uo pipefail
export FASTFORMER_COMMIT=${1:?the commit of this tree}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
{
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
    python3 -c 'import platform, torch, triton; print(platform.python_version(), torch.__version__, torch.version.cuda, triton.__version__)'
    lscpu | grep -E '^Model name|^CPU\(s\)'
    echo "commit $FASTFORMER_COMMIT"
} 2>&1 | tee "$OUT/environment.txt"
# Triton compiles into a cache the later runs share; both trees' kernels are compiled in round 0.
timeout --signal=INT --kill-after=10 330 python3 benchmarks/ab_throughput.py --baseline 0097ec4 \
    --baseline-tree ab-baseline-0097ec4 --rounds 3 --out-dir "$OUT/ab" -- \
    --train --preset base --quick --systems fastformer,fastformer-captured 2>&1 | tee "$OUT/ab.log"
echo "A/B ended at $(elapsed) s"
TOTAL_S=$(( 545 - $(elapsed) )) FASTFORMER_TEST_WORKERS=8 bash benchmarks/gpu_check.sh "$OUT/check" \
    --only install,pytest-gpu-marked 2>&1 | tail -n 40
echo "ended at $(elapsed) s"
