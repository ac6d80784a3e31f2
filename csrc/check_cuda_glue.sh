#!/usr/bin/env bash
# Compiles (syntax and types, no code) the torch glue of the CUDA build, csrc/*.cpp with FASTFORMER_WITH_CUDA, on a
# machine whose torch is a CPU build: nvcc checks the .cu kernels, this checks the C++ that launches them, which
# otherwise compiles only where a CUDA torch is installed. A CPU wheel ships c10/cuda's headers but not the one CMake
# generates (cuda_cmake_macros.h); an empty stand-in is made for it under OUT_DIR when the wheel lacks it.
set -euo pipefail
if [[ $# -ne 2 ]]; then
    echo "usage: $0 PYTHON OUT_DIR" >&2
    exit 2
fi
python=$1
out_dir=$2
csrc=$(cd "$(dirname "$0")" && pwd)
cuda_home=${CUDA_HOME:-/usr/local/cuda}
mapfile -t torch_includes < <("$python" -c "
import sysconfig
from torch.utils.cpp_extension import include_paths
print(*include_paths(), sysconfig.get_paths()['include'], sep='\n')")
macros="c10/cuda/impl/cuda_cmake_macros.h"
flags=(-std=c++17 -fsyntax-only -w -DFASTFORMER_WITH_CUDA=1 -I"$csrc" -I"$cuda_home/include")
for dir in "${torch_includes[@]}"; do flags+=(-I"$dir"); done
if [[ ! -f "${torch_includes[0]}/$macros" ]]; then
    mkdir -p "$out_dir/include/$(dirname "$macros")"
    echo "#pragma once" > "$out_dir/include/$macros"
    flags+=(-I"$out_dir/include")
fi
for source in $(grep -l FASTFORMER_WITH_CUDA "$csrc"/*.cpp); do
    echo "g++ -fsyntax-only -DFASTFORMER_WITH_CUDA $source"
    "${CXX:-g++}" "${flags[@]}" "$source"
done
