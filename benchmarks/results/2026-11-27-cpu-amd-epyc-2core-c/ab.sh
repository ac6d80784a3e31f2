# Scoring before and after block_attention, in alternating processes: OLD is a directory holding a build of the
# commit before (its fastformer/ with the extension built in place), the change is the installed package.
# Usage, from any directory: PYTHON=... OLD=... ROUNDS=6 bash ab.sh OUT_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$1"
mkdir -p "$out"
for round in $(seq 1 "${ROUNDS:-6}"); do
  for side in before after; do
    if [ $((round % 2)) -eq 0 ]; then side=$([ "$side" = before ] && echo after || echo before); fi
    if [ "$side" = before ]; then path="$OLD"; else path=""; fi
    PYTHONPATH="$path" OMP_NUM_THREADS=2 "$PYTHON" "$here/score_calls.py" --label "$side" >> "$out/ab_score.jsonl"
  done
done
