# One group's int8 GEMM floor (32 sentences, beam $1) alone on core 0, then two such processes on cores 0 and 1
# started together: whether two groups' GEMMs slow each other down. Prints the JSON lines.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
start() { echo $(( $(date +%s) + $1 )); }
t=$(start 25); taskset -c 0 "$python" "$here/limits.py" floor --beam "$1" --start "$t"
t=$(start 30)
taskset -c 0 "$python" "$here/limits.py" floor --beam "$1" --start "$t" &
taskset -c 1 "$python" "$here/limits.py" floor --beam "$1" --start "$t" &
wait
