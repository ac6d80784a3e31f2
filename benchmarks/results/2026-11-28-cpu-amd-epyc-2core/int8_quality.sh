#!/bin/bash
# int8 quality under the AVX2 cap on the demo's trained model (`fastformer demo`, 4000 steps): ef2b4f9 (8-bit
# weights) against ab10372 (7-bit weights on the AVX2 GEMM), each from its own tree with its extension built in place;
# float32 and uncapped int8 (AVX512-VNNI, 8-bit rows and weights) for scale.
#   bash int8_quality.sh CHECKPOINT OLD_TREE NEW_TREE
set -e
CK=$1 OLD=$2 NEW=$3
PY=${PY:-python}
D=$NEW/fastformer/data/corpus
W=$(mktemp -d)
tac $D/test.de > $W/other.de  # each source against another line's reference: spread-out log-probabilities
CAP="FASTFORMER_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2"
cd $W
echo "== evaluate, test split, beam 4, capped to AVX2"
for run in "float32 $NEW" "int8 $OLD" "int8 $NEW"; do
  set -- $run
  env $CAP PYTHONPATH=$2 $PY -m fastformer evaluate --checkpoint $CK --split test --compute-type $1 \
    --output $W/translations_$1_$(basename $2).txt 2>&1 | grep "tok:13a"
done
for tree in $OLD $NEW; do
  echo "int8 $(basename $tree): lines differing from float32: $(diff $W/translations_float32_$(basename $NEW).txt \
    $W/translations_int8_$(basename $tree).txt | grep -c '^<' || true) of $(wc -l < $W/translations_float32_$(basename $NEW).txt)"
done
echo "== score: mean and max |log-prob(int8) - log-prob(float32)| per target token"
for target in $D/test.de $W/other.de; do
  for run in "capped float32 $NEW" "capped int8 $OLD" "capped int8 $NEW" "uncapped float32 $NEW" "uncapped int8 $NEW"; do
    set -- $run
    if [ $1 = capped ]; then prefix="env $CAP"; else prefix="env"; fi
    $prefix PYTHONPATH=$3 $PY -m fastformer score --checkpoint $CK --input $D/test.en --targets $target \
      --compute-type $2 --tokens --output $W/score_$1_$2_$(basename $3).txt 2>/dev/null
  done
  for pair in "capped float32 $NEW capped int8 $OLD" "capped float32 $NEW capped int8 $NEW" \
              "uncapped float32 $NEW uncapped int8 $NEW"; do
    set -- $pair
    $PY - $W/score_$1_$2_$(basename $3).txt $W/score_$4_$5_$(basename $6).txt "$(basename $target): $4 $5 $(basename $6)" <<'P'
import sys
def tokens(path):
    return [[float(v) for v in line.split("\t")[2].split()] for line in open(path)]
a, b = tokens(sys.argv[1]), tokens(sys.argv[2])
d = [abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s)]
print(f"{sys.argv[3]}: {len(d)} tokens, mean {sum(d) / len(d):.5f}, max {max(d):.4f}")
P
  done
done
rm -rf $W
