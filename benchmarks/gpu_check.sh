#!/usr/bin/env bash
# The whole GPU check in one go, from the repository root of a checkout on a CUDA machine:
#
#     FASTFORMER_COMMIT=<hash> [FASTFORMER_TEST_WORKERS=8] bash benchmarks/gpu_check.sh OUT_DIR [--quick] [--only ...] \
#         [--archive FILE]
#
# 1. prints the device, versions and commit (FASTFORMER_COMMIT names it where the copy has no .git);
# 2. installs fastformer (compiling the CUDA extension for this GPU's architecture only) with the python3 in PATH;
# 3. runs every `gpu`-marked test, then the GPU-relevant test files in full, each with a junit XML and a log;
# 4. runs benchmarks/kernels.py and benchmarks/throughput.py, their JSON, PNG and log into OUT_DIR;
# 5. prints the GPU status rows (docs/gpu.md) that the steps run can fill (benchmarks/gpu_status.py), into
#    gpu_status.md.
# Each step is time-limited so that the whole run ends within TOTAL_S seconds (default 540, under a 10-minute
# limit; --quick: 420 and the benchmarks' quick modes). A failing step does not stop the later ones; the exit status
# is non-zero if any failed. OUT_DIR/summary.txt lists each step's status and duration.
# The steps: install, pytest-gpu-marked, pytest-gpu-files, memcheck, extension-errors, cpu-ops, kernels, throughput.
# --archive FILE packs OUT_DIR into FILE (.tar.gz) at the end: a machine that returns few files returns that one.
# The plan for a machine lent 15 minutes in all is docs/gpu.md's "A lease of 15 minutes".
# --only runs the listed ones (an unknown name is an error), so that a machine lent 10 minutes a command takes the
# whole check in parts, e.g.
# (each part on a fresh install):
#     --only install,pytest-gpu-marked,memcheck    --only install,pytest-gpu-files    --only install,kernels
#     --only install,throughput   (with TOTAL_S=560: throughput.py --train and --infer each need minutes)
# The throughput step's training section runs base, then big, each with fastformer, fastformer-captured (CUDA graphs),
# reference, reference-compile and torch-nn on the same bucketed batches; when its budget cuts big, run the training
# of each preset on its own (benchmarks/results/README.md lists the commands).
set -uo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 OUT_DIR [--quick] [--only STEP,STEP...]" >&2
    exit 2
fi
ALL_ARGS="$*"
OUT_DIR=$(mkdir -p "$1" && cd "$1" && pwd)
shift
QUICK=0
ONLY=""
ARCHIVE=""
STEPS=",install,pytest-gpu-marked,pytest-gpu-files,memcheck,extension-errors,cpu-ops,kernels,throughput,"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --only) ONLY=",${2:?--only needs a comma-separated list of steps},"; shift ;;
        --archive) ARCHIVE=$(realpath -m "${2:?--archive needs a file name}"); shift ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
# A misspelt step would run nothing and report success.
for step in ${ONLY//,/ }; do
    if [[ "$STEPS" != *",$step,"* ]]; then
        echo "unknown step '$step' in --only; the steps: ${STEPS//,/ }" >&2
        exit 2
    fi
done
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
if [[ $QUICK == 1 ]]; then TOTAL_S=${TOTAL_S:-420}; else TOTAL_S=${TOTAL_S:-540}; fi
START=$(date +%s)
FAILED=()
: > "$OUT_DIR/summary.txt"

remaining() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

# skip_step NAME REASON : records NAME as skipped (a failure of the run: what it would check went unchecked).
skip_step() {
    echo "skipped: $2" | tee "$OUT_DIR/$1.log"
    FAILED+=("$1")
    printf '%-22s %-8s %5s s\n' "$1" "skipped" 0 >> "$OUT_DIR/summary.txt"
}

# run_step NAME LIMIT_S SHOW command... : runs the command under `timeout` (at most LIMIT_S and what is left of
# TOTAL_S), its output in OUT_DIR/NAME.log; SHOW=all echoes the output live, SHOW=tail prints the last lines after.
run_step() {
    local name=$1 limit=$2 show=$3
    shift 3
    if [[ -n "$ONLY" && "$ONLY" != *",$name,"* ]]; then
        return
    fi
    local left
    left=$(( $(remaining) - 5 ))
    (( limit > left )) && limit=$left
    echo
    echo "=== $name (limit ${limit} s)"
    if (( limit < 20 )); then
        skip_step "$name" "the run's time budget is spent"
        return
    fi
    local begin rc
    begin=$(date +%s)
    if [[ $show == all ]]; then
        timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
        rc=${PIPESTATUS[0]}
    else
        timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
        rc=$?
        tail -n 25 "$OUT_DIR/$name.log"
    fi
    local status=ok
    if (( rc != 0 )); then
        status="rc=$rc"
        (( rc == 124 || rc == 130 || rc == 137 )) && status="timeout"
        FAILED+=("$name")
    fi
    printf '%-22s %-8s %5s s\n' "$name" "$status" "$(( $(date +%s) - begin ))" >> "$OUT_DIR/summary.txt"
    echo "--- $name: $status in $(( $(date +%s) - begin )) s"
}

# FASTFORMER_COMMIT, where given, names the tree (the GPU machine's copy once carried an older .git HEAD); else HEAD,
# and a copy whose files differ from it says so.
if [[ -n "${FASTFORMER_COMMIT:-}" ]]; then
    COMMIT=$FASTFORMER_COMMIT
else
    COMMIT=$(git -C "$REPO" rev-parse --verify -q HEAD 2>/dev/null || echo unknown)
    [[ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]] && COMMIT+="+dirty"
fi
export FASTFORMER_COMMIT=$COMMIT
COMMAND="bash benchmarks/gpu_check.sh $ALL_ARGS"
{
    echo "command: $COMMAND"
    echo "commit: $COMMIT"
    echo "date:   $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "mode:   $([[ $QUICK == 1 ]] && echo quick || echo full), budget ${TOTAL_S} s"
    python3 - <<'EOF'
import platform, torch
print(f"python: {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
try:
    import triton
    print(f"triton: {triton.__version__}")
except ImportError:
    print("triton: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
else:
    print("device: no CUDA device visible")
EOF
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null || true
} | tee "$OUT_DIR/environment.txt"

# Compile the extension for this GPU only (sm_90a on Hopper), which halves the build.
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
    TORCH_CUDA_ARCH_LIST=$(python3 -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}" + ("a" if m == 9 else ""))' 2>/dev/null || echo "8.0;9.0a")
    export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# A system-wide python3 may be marked externally managed; the GPU machine is throwaway.
export PIP_BREAK_SYSTEM_PACKAGES=1
# -v keeps the compiler's command lines in install.log.
run_step install 240 tail python3 -m pip install -v --no-build-isolation --no-deps --no-input .
if [[ " ${FAILED[*]} " == *" install "* ]]; then
    # Without the install, the Triton kernels can still be tested from the source tree (translate needs _C).
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    echo "install failed: testing the source tree"
fi

# FASTFORMER_TEST_WORKERS=N spreads the tests over N pytest-xdist processes: most of their time is Triton compiling
# kernels on the CPU, which one process does serially (the one serial run, on an H100, ran out of its step's time).
# Unset: up to 8, where pytest-xdist is installed.
if [[ -z "${FASTFORMER_TEST_WORKERS:-}" ]] && python3 -c 'import xdist' 2>/dev/null; then
    FASTFORMER_TEST_WORKERS=$(( $(nproc) < 8 ? $(nproc) : 8 ))
fi
WORKERS=${FASTFORMER_TEST_WORKERS:+-n $FASTFORMER_TEST_WORKERS}
# pytest runs from OUT_DIR so that the installed package (with its compiled _C), not the source tree, is imported.
# The decoding files run whole too: their CPU batch-invariance tests probe the GEMMs of the machine's CPU, which on
# the GPU machine's Intel Xeon rounded a row by the batch's row count (benchmarks/results/2026-11-27-nvidia-h200/).
GPU_FILES=()
for file in test_layernorm_kernel.py test_attention_kernel.py test_cross_entropy_kernel.py test_model_fused.py \
            test_beam_search.py test_extension.py test_search_options.py test_alignment.py test_scoring.py; do
    [[ -f "$REPO/tests/$file" ]] && GPU_FILES+=("$REPO/tests/$file")
done
run_step pytest-gpu-marked 180 tail bash -c "cd '$OUT_DIR' && python3 -m pytest '$REPO/tests' -m gpu -q -ra $WORKERS \
    -p no:cacheprovider --junitxml='$OUT_DIR/pytest-gpu-marked.xml'"
run_step pytest-gpu-files 210 tail bash -c "cd '$OUT_DIR' && python3 -m pytest ${GPU_FILES[*]} -m 'not gpu' -q -ra $WORKERS \
    -p no:cacheprovider --junitxml='$OUT_DIR/pytest-gpu-files.xml'"

# compute-sanitizer memcheck over translate runs of the compiled CUDA beam search (fp32, fp16, a wide beam; the
# bucketed search with its CUDA graphs, and the every-step one, translate's default).
run_step memcheck 90 tail bash -c "cd '$OUT_DIR' && compute-sanitizer --tool memcheck --error-exitcode 1 python3 -c '
import torch, fastformer
torch.manual_seed(0)
model = fastformer.Transformer(fastformer.TransformerConfig.tiny(1000, dropout=0.0)).cuda().eval()
src = torch.randint(3, 1000, (6, 12), device=\"cuda\"); src[:, -1] = 2; src[3, 4] = 2; src[3, 5:] = 0
print(model.translate(src, beam_size=4, n_best=2, max_len_b=10, shrink=\"buckets\")[0])
print(model.translate(src, beam_size=4, n_best=2, max_len_b=10, shrink=\"every_step\")[0])
print(model.translate(src, beam_size=32, max_len_b=6)[0])
print(model.half().translate(src, beam_size=8, max_len_b=10)[0])
'"

# compute-sanitizer refuses some machines' GPUs (a gVisor sandbox's: "Device not supported"): that is no finding
# about the code, and the summary says so.
if grep -q "Device not supported" "$OUT_DIR/memcheck.log" 2>/dev/null; then
    sed -i 's/^\(memcheck  *\)[^ ]*/\1unsupported/' "$OUT_DIR/summary.txt"
    for index in "${!FAILED[@]}"; do [[ "${FAILED[$index]}" == memcheck ]] && unset "FAILED[$index]"; done
fi

# An error raised in the extension's C++ must reach Python as a RuntimeError (benchmarks/extension_error_probe.py).
run_step extension-errors 120 tail bash -c "cd '$OUT_DIR' && python3 '$REPO/benchmarks/extension_error_probe.py'"

# The CPU ops' own checks (CMakeLists.txt's ctest) built with this machine's compiler and run on its CPU: their bitwise
# claims (a row alike alone and in any group or batch) rest on how a compiler rounds, and this machine's GCC is not
# CI's (benchmarks/results/2026-11-27-nvidia-h200-b/).
run_step cpu-ops 150 tail bash -c "g++ --version | head -n 1 \\
    && cmake -S '$REPO' -B /tmp/fastformer-cpu-ops -DFASTFORMER_WERROR=OFF > /dev/null \\
    && cmake --build /tmp/fastformer-cpu-ops --target test_cpu_ops -j $MAX_JOBS && /tmp/fastformer-cpu-ops/test_cpu_ops"

QUICK_FLAG=()
[[ $QUICK == 1 ]] && QUICK_FLAG=(--quick)
# The whole benchmark took 165 s on an H200 (attention alone 137 s).
run_step kernels 240 all python3 benchmarks/kernels.py --out-dir "$OUT_DIR" ${QUICK_FLAG[@]+"${QUICK_FLAG[@]}"}
# throughput.py starts no new measurement once its own budget is spent; if the step's timeout still interrupts it
# (SIGINT), it writes its table, JSON and chart of what it measured before exiting.
BUDGET=$(( $(remaining) - 45 ))
if (( BUDGET < 60 )) && [[ -z "$ONLY" || "$ONLY" == *",throughput,"* ]]; then
    # Too little left to time anything: say so, rather than an "ok" step that measured nothing.
    echo
    echo "=== throughput"
    skip_step throughput "${BUDGET} s of the run's budget left to time in"
else
    run_step throughput 600 all python3 benchmarks/throughput.py --out-dir "$OUT_DIR" --time-budget-s "$BUDGET" \
        ${QUICK_FLAG[@]+"${QUICK_FLAG[@]}"}
fi

echo
echo "=== summary ($(( $(date +%s) - START )) s, commit $COMMIT)"
cat "$OUT_DIR/summary.txt"
echo
echo "=== docs/gpu.md \"GPU status\" rows this run can fill (also in gpu_status.md)"
python3 "$REPO/benchmarks/gpu_status.py" "$OUT_DIR" "$COMMIT" | tee "$OUT_DIR/gpu_status.md"
if [[ -n "$ARCHIVE" ]]; then
    tar -czf "$ARCHIVE" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" && echo "packed $OUT_DIR into $ARCHIVE"
fi
if (( ${#FAILED[@]} )); then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
echo "all steps passed"
