# float32 capped to AVX2 before and after fastformer's own float32 GEMM, in alternating runs of cpu_decoding.py:
# OLD is a checkout of the commit before with its extension built in place (its own cpu_decoding.py runs it), the
# change is the installed package beside CTranslate2 at its best. Usage: PYTHON=... OLD=... ROUNDS=3 bash ab.sh OUT_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$1"
mkdir -p "$out"
points=(--shape b --vocab 37000 --threads 1 2 --beam 1 4 --sentences 64 --cap-isa avx2 --rounds 1)
for round in $(seq 1 "${ROUNDS:-3}"); do
  for side in before after; do
    if [ $((round % 2)) -eq 0 ]; then side=$([ "$side" = before ] && echo after || echo before); fi
    if [ "$side" = before ]; then
      PYTHONPATH="$OLD" "$PYTHON" "$OLD/benchmarks/cpu_decoding.py" "${points[@]}" --systems fastformer-float32 \
        --out "$out/before-$round.json" > "$out/before-$round.log" 2>&1
    else
      PYTHONPATH= "$PYTHON" "$here/../../cpu_decoding.py" "${points[@]}" \
        --systems fastformer-float32 ctranslate2-float32 --out "$out/after-$round.json" > "$out/after-$round.log" 2>&1
    fi
  done
done
