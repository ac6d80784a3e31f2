# Translation before and after the encoder's padding change, in alternating processes: OLD is a directory holding a
# build of the commit before (its fastformer/ with the extension built in place), the change is the installed package.
# Usage, from any directory: PYTHON=... OLD=... ROUNDS=4 bash ab.sh OUT_DIR SYSTEM [--padded]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$1"
system="$2"
shift 2
mkdir -p "$out"
for round in $(seq 1 "${ROUNDS:-4}"); do
  for side in before after; do
    if [ $((round % 2)) -eq 0 ]; then side=$([ "$side" = before ] && echo after || echo before); fi
    if [ "$side" = before ]; then path="$OLD"; else path=""; fi
    PYTHONPATH="$path" OMP_NUM_THREADS=2 "$PYTHON" "$here/calls.py" --system "$system" --label "$side" "$@" \
      >> "$out/ab_$system.jsonl"
  done
done
