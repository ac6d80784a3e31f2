#!/usr/bin/env bash
# The int8 beam-4 search's perf profile, its calls alone (search_calls.py): one group of 32 sentences on one thread,
# then 64 sentences on two threads (two groups of 32, one a thread), 12 searches each, samples a symbol.
#   PYTHONPATH=<a build's checkout> bash profile_threads.sh OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$1
mkdir -p "$out"
for run in "1 32" "2 64"; do
  set -- $run
  rm -f "$out/go"
  python "$here/search_calls.py" "$1" "$2" 12 "$out/go" > "$out/calls_$1.txt" &
  pid=$!
  until grep -q steady "$out/calls_$1.txt"; do sleep 0.5; done
  perf record -F 999 -g -p "$pid" -o "$out/perf_$1.data" > /dev/null 2>&1 &
  perf_pid=$!
  sleep 1
  touch "$out/go"
  until grep -q "a search" "$out/calls_$1.txt"; do sleep 0.1; done
  kill -INT "$perf_pid"
  wait "$perf_pid" || true
  wait "$pid"
  tail -1 "$out/calls_$1.txt"
  perf report -i "$out/perf_$1.data" --no-children --sort dso,symbol -g none -n 2> /dev/null \
    | grep -E "^ +[0-9]" | tr -s " " | cut -c1-110 | head -14 || true
done
