# bash alternate.sh ROUNDS SYSTEMS BEFORE: in_turn.py in a process of the package installed at BEFORE (pip install
# --target) and one of the installed package, in turn, ROUNDS times; a JSON line each, "before" or "after" first.
here=$(cd "$(dirname "$0")" && pwd)
for round in $(seq 1 "$1"); do
  for which in before after; do
    path=$([ "$which" = before ] && echo "$3")
    (cd /tmp && PYTHONPATH=$path OMP_NUM_THREADS=2 python "$here/in_turn.py" "$2" | sed "s/^/$which /")
  done
done
