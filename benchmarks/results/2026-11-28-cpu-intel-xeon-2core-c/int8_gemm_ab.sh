# int8_gemm_ab.sh BEFORE AFTER ISA [K]: six alternating runs of each binary at each shape; the route ISA's medians.
# With K, the output projection's shapes summarized (int8_gemm_ab.cpp's k), else every shape's outputs written.
if [ -n "$4" ]; then shapes=("64 512 37000 $4" "256 512 37000 $4"); else
  shapes=("128 512 2048" "64 512 37000" "384 512 37000" "1344 512 2048" "128 2048 512"); fi
for shape in "${shapes[@]}"; do
  before=""; after=""
  for i in 1 2 3 4 5 6; do
    before="$before $($1 $shape | grep -- " $3 best" | awk '{print $(NF-1)}')"
    after="$after $($2 $shape | grep -- " $3 best" | awk '{print $(NF-1)}')"
  done
  echo "$3 $shape | before:$before | after:$after"
done
