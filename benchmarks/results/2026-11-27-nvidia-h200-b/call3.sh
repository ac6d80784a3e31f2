#!/usr/bin/env bash
# Third call: which library makes a float32 translation on this Intel Xeon differ alone and in a batch? Two failing
# tests of call 2 under settings that each take one suspect out (fastformer's own loops, oneDNN's, MKL's), side by side.
set -uo pipefail
REPO=$(pwd)
TESTS=("$REPO/tests/test_alignment.py::test_attention_does_not_depend_on_the_batch[every_step-float32]"
       "$REPO/tests/test_search_options.py::test_every_option_translates_a_sentence_the_same_alone_and_in_a_batch[options0-every_step-float32]")
CONFIGS=("" "FASTFORMER_CPU_ISA=avx2" "FASTFORMER_CPU_ISA=baseline" "ONEDNN_MAX_CPU_ISA=AVX512_CORE"
         "ONEDNN_MAX_CPU_ISA=AVX2" "MKL_CBWR=COMPATIBLE" "MKL_ENABLE_INSTRUCTIONS=AVX2"
         "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FASTFORMER_CPU_ISA=avx2")
mkdir -p "$OUT/configs"
for i in "${!CONFIGS[@]}"; do
    (cd "$OUT" && env OMP_NUM_THREADS=2 ${CONFIGS[$i]} timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short \
        "${TESTS[@]}" > "$OUT/configs/$i.log" 2>&1) &
done
wait
for i in "${!CONFIGS[@]}"; do
    echo "== [${CONFIGS[$i]:-default}] $(tail -n 1 "$OUT/configs/$i.log")"
    grep -E "^E " "$OUT/configs/$i.log" | head -n 4
done
