#!/usr/bin/env bash
# Three builds of the self-attention op in turn, ROUNDS rounds (attention_step_bench.py, 64 MiB evicted between
# steps): HEAD's (float16 caches, and float32's), the int8 cache trial's, the heads-outer trial's.
#   bash attention_trials.sh HEAD_TREE INT8_TREE HEADS_OUTER_TREE ROUNDS
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for round in $(seq "$4"); do
  echo "round $round"
  for kind in random shared own; do
    echo -n "HEAD        "; PYTHONPATH=$1 python "$here/attention_step_bench.py" half 64 $kind
    echo -n "HEAD        "; PYTHONPATH=$1 python "$here/attention_step_bench.py" float 64 $kind
    echo -n "int8 cache  "; PYTHONPATH=$2 python "$here/attention_step_bench.py" int8 64 $kind
    echo -n "heads outer "; PYTHONPATH=$3 python "$here/attention_step_bench.py" half 64 $kind
  done
done
