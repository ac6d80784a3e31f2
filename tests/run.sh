#!/usr/bin/env bash
# The test command: builds a fresh venv with the pinned CPU dependencies, installs fastformer (compiling its
# extension), checks when nvcc is present that every CUDA source compiles and so does the C++ that launches it,
# builds the C++ ops with CMake and runs their ctest, compiles every Triton kernel launch for sm_90/sm_80
# (tests/test_triton_aot.py), then runs the rest of pytest against the installed package. Extra arguments go to
# pytest, which then runs the whole of tests/ (the AOT compile included) with them. One line per step says what it
# does and when it started.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=$(( $# == 0 ? 8 : 7 ))
step=0
say() {
    step=$((step + 1))
    printf '\n== [%d/%d] %s (at %d min %02d s)\n' "$step" "$STEPS" "$1" $((SECONDS / 60)) $((SECONDS % 60))
}
say "virtual environment .venv with the pinned dependencies (requirements.txt)"
python3 -m venv .venv
.venv/bin/pip install -q -r requirements.txt
say "build and install fastformer and its C++ extension"
# setuptools never prunes build/lib: a module deleted or renamed since the last build would be installed and tested
# still. build/temp keeps ninja's objects, so a rebuild compiles only what changed.
rm -rf build/lib.* build/bdist.*
.venv/bin/pip install -q --no-build-isolation .
if command -v nvcc >/dev/null; then
    say "nvcc: compile every csrc/*.cu for sm_80 and sm_90a"
    bash csrc/compile_cuda.sh build/nvcc
    say "g++ -fsyntax-only: the CUDA build's torch glue (csrc/*.cpp with FASTFORMER_WITH_CUDA)"
    bash csrc/check_cuda_glue.sh .venv/bin/python build/cuda-glue
else
    say "nvcc: not found, CUDA sources not compiled"
    say "no CUDA toolkit: the CUDA build's torch glue not checked"
fi
# The C++ side without Python: the torch-free CPU ops against brute-force loops (ctest).
say "CMake: build the C++ ops and their test"
cmake -S . -B build/cmake -Wno-dev >/dev/null
cmake --build build/cmake -j2 >/dev/null
say "ctest: the C++ ops against brute-force loops"
ctest --test-dir build/cmake --output-on-failure
# pytest's own entry point keeps the source tree off sys.path, so the tests import the installed package.
if [ $# -eq 0 ]; then
    say "pytest tests/test_triton_aot.py: Triton's compiler on every kernel launch for sm_90 and sm_80, on every core (minutes from an empty build/triton-aot-cache, seconds from a full one)"
    .venv/bin/pytest tests/test_triton_aot.py -q -ra
    say "pytest: every other test (the gpu-marked ones skip without a CUDA device)"
    .venv/bin/pytest tests -q -ra --ignore tests/test_triton_aot.py
else
    say "pytest tests $*"
    .venv/bin/pytest tests -q -ra "$@"
fi
printf '\n== done in %d min %02d s\n' $((SECONDS / 60)) $((SECONDS % 60))
