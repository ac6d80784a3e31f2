#!/usr/bin/env bash
# The commands of this lease, each one call from the repository root of the GPU machine's copy ($OUT is the folder whose
# files came back; a call returns at most 8 files, so the check's folder comes back tarred).
# Call 1: the check's install, tests, memcheck, C++-error probe and the CPU ops' ctest under the machine's compiler
# on 75c8256 (the AVX2 int8 GEMM's first build by GCC 13.3), then kernels.py's sections that had not run on a GPU:
# cross-entropy, linear + cross-entropy and the residual LayerNorm.
call1() {
    export PYTHONUNBUFFERED=1 FASTFORMER_TEST_WORKERS=8 TOTAL_S=360
    lscpu > /tmp/lscpu.txt
    bash benchmarks/gpu_check.sh /tmp/g --only install,pytest-gpu-marked,pytest-gpu-files,memcheck,extension-errors,cpu-ops
    echo "=== kernels: cross_entropy, linear_cross_entropy, residual_layer_norm"
    timeout --signal=INT --kill-after=10 170 python3 benchmarks/kernels.py \
        --ops cross_entropy,linear_cross_entropy,residual_layer_norm --out-dir /tmp/g/kernels 2>&1 | tee /tmp/g/kernels.log
    cp /tmp/g/summary.txt /tmp/g/gpu_status.md /tmp/lscpu.txt "$OUT"/
    tar czf "$OUT/g.tar.gz" -C /tmp g
}
# Call 2: with the fix of test_model_fused.py's environment leak, the GPU-relevant test files again, then the
# inference section of throughput.py (base) at this commit in what is left of the call.
call2() {
    export PYTHONUNBUFFERED=1 FASTFORMER_TEST_WORKERS=8 TOTAL_S=${TOTAL_S:-450}
    bash benchmarks/gpu_check.sh /tmp/g --only install,pytest-gpu-files
    budget=$(( TOTAL_S - 75 - $(awk '{s += $(NF - 1)} END {print s}' /tmp/g/summary.txt) ))
    echo "=== throughput --infer --preset base (budget $budget s)"
    timeout --signal=INT --kill-after=15 $(( budget + 40 )) python3 benchmarks/throughput.py --infer --preset base \
        --out-dir /tmp/g/throughput --time-budget-s "$budget" 2>&1 | tee /tmp/g/throughput.log
    cp /tmp/g/summary.txt "$OUT"/
    tar czf "$OUT/g.tar.gz" -C /tmp g
}
"call${1:?usage: calls.sh 1|2}"
