# The package before the outputs' prefetch (the installed one, eadb8d0) against the one after (built in place in the
# checkout, CHECKOUT), alternating which goes first, ROUNDS rounds; nothing else running. From outside the checkout:
#   PYTHON=/path/to/.venv/bin/python CHECKOUT=/path/to/checkout ROUNDS=4 bash ab.sh OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$1
python=${PYTHON:-python}
mkdir -p "$out"
side() {  # side NAME ROUND: one side's GEMM rates and calls
  local path=""
  [ "$1" = after ] && path=$CHECKOUT
  PYTHONPATH=$path "$python" "$here/limits.py" gemm > "$out/ab-$1-$2-gemm.json"
  PYTHONPATH=$path OMP_NUM_THREADS=2 "$python" "$here/calls.py" > "$out/ab-$1-$2-calls.json"
}
for round in $(seq 1 "${ROUNDS:-4}"); do
  if [ $((round % 2)) = 1 ]; then side before "$round"; side after "$round"; else side after "$round"; side before "$round"; fi
done
