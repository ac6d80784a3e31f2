# bash amx_trials.sh REPO PAIRS: builds the CPU ops' library (cmake) of REPO's tree, and of the tree with each patch
# here applied, links amx_kernel_bench.cpp to each, then at each shape runs the tree's bench and a trial's in turn
# PAIRS times: their medians and the median (and range) of the pairs' ratios, trial / tree. diagnostics.patch is
# built twice: with -DNO_OUTPUT_PREFETCH (the tile asks for no output lines) and with -DNO_OUTPUTS (it writes none).
set -e
repo=$(realpath "$1"); pairs=${2:-8}; here=$(dirname "$(realpath "$0")"); work=$(mktemp -d)
build() {  # build NAME PATCH [FLAGS]: $work/bench_NAME
  mkdir -p "$work/$1" && git -C "$repo" archive HEAD CMakeLists.txt csrc | tar -x -C "$work/$1"
  if [ -n "$2" ]; then patch -s -d "$work/$1" -p1 < "$2"; fi
  cmake -S "$work/$1" -B "$work/$1/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="$3" > /dev/null
  cmake --build "$work/$1/build" -j2 --target fastformer_cpu > /dev/null
  g++ -O2 -std=c++17 -I"$work/$1/csrc" "$here/amx_kernel_bench.cpp" "$work/$1/build/libfastformer_cpu.a" -fopenmp \
      -o "$work/bench_$1"
}
build tree ""
build overlap "$here/overlap.patch"
build pass_panels "$here/pass_panels.patch"
build spread_output_prefetch "$here/spread_output_prefetch.patch"
build no_output_prefetch "$here/diagnostics.patch" -DNO_OUTPUT_PREFETCH
build no_outputs "$here/diagnostics.patch" -DNO_OUTPUTS
for shape in "128 512 512" "128 512 2048" "128 2048 512" "992 512 2048" "128 512 37000"; do
  for trial in overlap pass_panels spread_output_prefetch no_output_prefetch no_outputs; do
    python3 - "$work" "$trial" "$pairs" $shape <<'PY'
import statistics, subprocess, sys
work, trial, pairs, shape = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
def rate(name):
    out = subprocess.run([f"{work}/bench_{name}", *shape], capture_output=True, text=True, check=True).stdout
    return float(out.split(" G/s")[0].split()[-1])
tree, tried = [], []
for _ in range(pairs):
    tree.append(rate("tree")); tried.append(rate(trial))
ratios = [t2 / t1 for t1, t2 in zip(tree, tried)]
print(" x ".join(shape), f"| tree {statistics.median(tree):.0f} G/s | {trial} {statistics.median(tried):.0f} G/s |",
      f"ratio {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
PY
  done
done
rm -rf "$work"
