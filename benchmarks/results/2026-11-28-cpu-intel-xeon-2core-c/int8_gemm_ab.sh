# int8_gemm_ab.sh BEFORE AFTER ISA: six alternating runs of each binary at each shape; the route ISA's medians.
for shape in "128 512 2048" "64 512 37000" "384 512 37000" "1344 512 2048" "128 2048 512"; do
  before=""; after=""
  for i in 1 2 3 4 5 6; do
    before="$before $($1 $shape | grep -- " $3 best" | awk '{print $(NF-1)}')"
    after="$after $($2 $shape | grep -- " $3 best" | awk '{print $(NF-1)}')"
  done
  echo "$3 $shape | before:$before | after:$after"
done
