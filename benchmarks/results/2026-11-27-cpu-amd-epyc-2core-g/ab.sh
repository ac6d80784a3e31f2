#!/usr/bin/env bash
# Two trees' CPU decoding at the headline shape (base model, 37k vocabulary, 64 sentences, beam 4, 1 and 2 threads,
# fastformer float32 and int8), in pairs whose order alternates, each tree's benchmarks/cpu_decoding.py importing
# that tree's package (its extension built in place: python setup.py build_ext --inplace), one round a run:
#
#     bash ab.sh OLD_TREE NEW_TREE OUT_DIR [PAIRS]      # then: python ab_summary.py OUT_DIR
set -euo pipefail
old=$(cd "$1" && pwd) new=$(cd "$2" && pwd) out=$(mkdir -p "$3" && cd "$3" && pwd) pairs=${4:-3}
python=${PYTHON:-python3}
run() {  # run SIDE TREE PAIR
    (cd /tmp && PYTHONPATH="$2" "$python" "$2/benchmarks/cpu_decoding.py" --shape b --vocab 37000 \
        --systems fastformer-float32 fastformer-int8 --threads 1 2 --sentences 64 --beam 4 --rounds 1 \
        --out "$out/$1-$3.json" > "$out/$1-$3.log" 2>&1)
}
for pair in $(seq 1 "$pairs"); do
    if (( pair % 2 )); then run old "$old" "$pair"; run new "$new" "$pair"
    else run new "$new" "$pair"; run old "$old" "$pair"; fi
done
