# bash row_tiles_alternate.sh ROUNDS BEFORE AFTER ROWS...: row_tiles_bench.py from the package at BEFORE and at
# AFTER (PYTHONPATH), in turn, ROUNDS times, under each GEMM: AVX512-VNNI (AMX off), AVX-VNNI (capped to AVX2), AVX2
# (VNNI off too).
here=$(cd "$(dirname "$0")" && pwd)
rounds=$1 before=$2 after=$3
shift 3
for round in $(seq 1 "$rounds"); do
  for gemm in "FASTFORMER_CPU_AMX=0" "FASTFORMER_CPU_ISA=avx2" "FASTFORMER_CPU_ISA=avx2 FASTFORMER_CPU_VNNI=0"; do
    for which in before after; do
      path=$([ "$which" = before ] && echo "$before" || echo "$after")
      echo "== round $round, $which, $gemm"
      (cd /tmp && env $gemm PYTHONPATH="$path" OMP_NUM_THREADS=1 python "$here/row_tiles_bench.py" "$@")
    done
  done
done
