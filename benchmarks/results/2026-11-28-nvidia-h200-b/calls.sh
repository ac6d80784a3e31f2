#!/usr/bin/env bash
# The commands of this lease, each one call from the repository root of the GPU machine's copy ($OUT is the folder whose
# files came back; a call returns at most 8 files, so the check's folder comes back tarred).
# Call 1: install and the GPU tests on 2c2b3cb (dispatch's interpreter check of acf3b2c and 2c2b3cb had not run on a
# GPU), then throughput.py's inference section in quick mode (the README's GPU translation rows are an H100's of
# 184540c) in what is left of the call.
call1() {
    export PYTHONUNBUFFERED=1 FASTFORMER_TEST_WORKERS=8 TOTAL_S=${TOTAL_S:-540}
    bash benchmarks/gpu_check.sh /tmp/g --only install,pytest-gpu-marked,pytest-gpu-files
    budget=$(( TOTAL_S - 60 - $(awk '{s += $(NF - 1)} END {print s}' /tmp/g/summary.txt) ))
    echo "=== throughput --infer --quick --preset base (budget $budget s)"
    timeout --signal=INT --kill-after=15 $(( budget + 40 )) python3 benchmarks/throughput.py --infer --quick \
        --preset base --out-dir /tmp/g/throughput --time-budget-s "$budget" 2>&1 | tee /tmp/g/throughput.log
    cp /tmp/g/summary.txt /tmp/g/gpu_status.md "$OUT"/
    tar czf "$OUT/g.tar.gz" -C /tmp g
}
# Call 2, on the same warm machine (fastformer installed by call 1): call 1's inference ran every system at one
# sentence a call before its budget ran out, so the batched row that the README's GPU translation rows compare.
call2() {
    export PYTHONUNBUFFERED=1
    timeout --signal=INT --kill-after=10 220 python3 benchmarks/throughput.py --infer --quick --preset base \
        --batch-sizes 256 --systems fastformer,cached-pytorch,reference --out-dir "$OUT/t" --time-budget-s 180
}
# Call 3, the same machine: the 32-sentence row, then the training section in quick mode at this commit.
call3() {
    export PYTHONUNBUFFERED=1
    timeout --signal=INT --kill-after=10 70 python3 benchmarks/throughput.py --infer --quick --preset base \
        --batch-sizes 32 --systems fastformer,cached-pytorch --out-dir "$OUT/b32" --time-budget-s 50
    timeout --signal=INT --kill-after=10 150 python3 benchmarks/throughput.py --train --quick --preset base \
        --systems fastformer-captured,fastformer,reference --out-dir "$OUT/train" --time-budget-s 120
}
"call${1:?usage: calls.sh 1|2|3}"
