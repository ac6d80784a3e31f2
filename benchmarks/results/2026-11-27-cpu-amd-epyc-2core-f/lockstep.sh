# lockstep.py's part $1 (floor or search) in compute type $2 alone on core 0, then two such processes on cores 0
# and 1 started together: whether two groups slow each other down. Prints the JSON lines (alone first).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
start() { echo $(( $(date +%s) + $1 )); }
t=$(start 40); taskset -c 0 "$python" "$here/lockstep.py" "$1" "$2" --start "$t"
t=$(start 45)
taskset -c 0 "$python" "$here/lockstep.py" "$1" "$2" --start "$t" &
taskset -c 1 "$python" "$here/lockstep.py" "$1" "$2" --start "$t" &
wait
