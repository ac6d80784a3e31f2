#!/usr/bin/env bash
# Compiles every csrc/*.cu with nvcc for Ampere (sm_80) and Hopper (sm_90a) into OUT_DIR, failing on the first
# error. The kernels are torch-free, so this needs only nvcc; CI runs it to keep them compiling on both targets.
set -euo pipefail
if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
out_dir=$1
csrc=$(cd "$(dirname "$0")" && pwd)
nvcc=${NVCC:-nvcc}
mkdir -p "$out_dir"
shopt -s nullglob
sources=("$csrc"/*.cu)
if [[ ${#sources[@]} -eq 0 ]]; then
    echo "no .cu files in $csrc" >&2
    exit 1
fi
for source in "${sources[@]}"; do
    object="$out_dir/$(basename "${source%.cu}").o"
    echo "nvcc $source -> $object"
    "$nvcc" -std=c++17 -O3 --use_fast_math -Werror all-warnings -I"$csrc" \
        -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a \
        -c "$source" -o "$object"
done
