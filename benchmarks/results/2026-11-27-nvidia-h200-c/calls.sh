#!/usr/bin/env bash
# The four commands of this lease, each as one call from the repository root of the GPU machine's copy ($OUT is the
# folder whose files came back). Calls 1-2 ran on the tree of cffaa09, calls 3-4 on the tree of the next commit.
# Call 1 (480 s): the whole check, its folder tarred because a call returns at most 8 files.
call1() {
    export PYTHONUNBUFFERED=1 FASTFORMER_TEST_WORKERS=8 TOTAL_S=500
    lscpu > /tmp/lscpu.txt
    bash benchmarks/gpu_check.sh /tmp/g
    cp /tmp/g/summary.txt /tmp/g/gpu_status.md /tmp/lscpu.txt "$OUT"/
    tar czf "$OUT/g.tar.gz" -C /tmp g
}
# Call 2 (89 s): the CPU ops' ctest under the machine's GCC 13.3 with the compiler's fusing of multiply-adds off,
# at its default (fast), and at -O2.
call2() {
    for f in "-ffp-contract=off" "-ffp-contract=fast" "-O2"; do
        rm -rf /tmp/b
        cmake -S . -B /tmp/b -DFASTFORMER_WERROR=OFF "-DCMAKE_CXX_FLAGS=$f" > /dev/null \
            && cmake --build /tmp/b --target test_cpu_ops -j 16 > /dev/null 2>&1
        echo "== $f"
        /tmp/b/test_cpu_ops 2>&1 | tail -6
    done
}
# Call 3 (29 s, a fresh machine): the ctest with the multiply-adds spelled out and the fusing off in the build.
call3() {
    g++ --version | head -1
    cmake -S . -B /tmp/b -DFASTFORMER_WERROR=OFF > /dev/null \
        && cmake --build /tmp/b --target test_cpu_ops -j 16 2>&1 | grep -iE "warning|error" | head
    /tmp/b/test_cpu_ops
    echo rc=$?
}
# Call 4 (154 s, the same machine): that tree installed, then the decoding tests that check batch invariance.
call4() {
    export PIP_BREAK_SYSTEM_PACKAGES=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
    python3 -m pip install -q --no-build-isolation --no-deps --no-input . > /tmp/i.log 2>&1 || tail -5 /tmp/i.log
    cd /tmp && timeout 100 python3 -m pytest /work/main/tests/test_search_options.py /work/main/tests/test_alignment.py \
        /work/main/tests/test_scoring.py -q -n 8 -p no:cacheprovider -m 'not gpu' 2>&1 | tail -4
}
"call${1:?usage: calls.sh 1|2|3|4}"
