#!/usr/bin/env bash
# The test command: builds a fresh venv with the pinned CPU dependencies, installs fastformer (compiling its
# extension), checks that every CUDA source compiles with nvcc when nvcc is present, builds the C++ ops with CMake
# and runs their ctest, then runs pytest against the installed package. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -r requirements.txt
.venv/bin/pip install -q --no-build-isolation .
if command -v nvcc >/dev/null; then
    bash csrc/compile_cuda.sh build/nvcc
fi
# The C++ side without Python: the torch-free CPU ops against brute-force loops (ctest).
cmake -S . -B build/cmake -Wno-dev >/dev/null
cmake --build build/cmake -j2 >/dev/null
ctest --test-dir build/cmake --output-on-failure
# pytest's own entry point keeps the source tree off sys.path, so the tests import the installed package.
.venv/bin/pytest tests -q -ra "$@"
