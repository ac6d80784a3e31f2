# One call on a lent GPU machine, from the repository root: bash benchmarks/results/2026-11-27-nvidia-h200/call1.sh
# Logs into /tmp/r, packed into $OUT/call1.tar.gz. Each step is time-limited so the call ends within 560 s.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PIP_BREAK_SYSTEM_PACKAGES=1
REPO=$PWD; HERE=$REPO/benchmarks/results/2026-11-27-nvidia-h200
R=/tmp/r; mkdir -p $R /tmp/w
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { local l=$(( 550 - ($(date +%s) - T0) )); (( l > $1 )) && l=$1; (( l < 5 )) && l=5; echo $l; }
pack() { tar czf $OUT/call1.tar.gz -C /tmp r; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch, triton, platform; print(platform.python_version(), torch.__version__, torch.version.cuda, triton.__version__)'; c++ --version | head -1; nvcc --version | tail -2; } > $R/environment.txt 2>&1
cat $R/environment.txt
# The install (HEAD as it is) and the toy link variants at once: 16 cores.
( python3 -m pip install -v --no-build-isolation --no-deps --no-input . > $R/install.log 2>&1; echo "rc=$?" >> $R/install.log ) &
INSTALL=$!
(cd /tmp/w && timeout $(left 200) python3 $HERE/link_probe.py > $R/link_probe.log 2>&1); el "link probe rc=$?"
wait $INSTALL; el "install $(tail -1 $R/install.log)"
cat $R/link_probe.log | cut -c1-220
cd /tmp/w
timeout $(left 90) python3 $REPO/benchmarks/extension_error_probe.py --no-toy > $R/extension_errors.log 2>&1; el "probe rc=$?"; cat $R/extension_errors.log | grep -v "^\s" | cut -c1-200
pack
timeout $(left 130) python3 -m pytest $REPO/tests -m gpu -q -ra -n 8 -p no:cacheprovider > $R/pytest-gpu-marked.log 2>&1; el "gpu-marked rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest-gpu-marked.log | tail -8 | cut -c1-250
pack
timeout $(left 60) compute-sanitizer --tool memcheck --error-exitcode 1 python3 $HERE/memcheck_strided.py > $R/memcheck.log 2>&1; el "memcheck rc=$?"; tail -3 $R/memcheck.log | cut -c1-200
pack
# The link variant that raised the toy's integer check, applied to setup.py, rebuilt, probed and tested.
WINNER=$(python3 - <<'PY'
import re
text = open("/tmp/r/link_probe.log").read()
for variant in ("libstdcxx-first", "static-libstdcxx"):
    block = text.split(f"== {variant} ")[1].split("\n== ")[0] if f"== {variant} " in text else ""
    if "check_int(7): raised a RuntimeError" in block:
        print(variant)
        break
PY
)
el "winner: ${WINNER:-none}"
if [[ -n "$WINNER" ]]; then
    cd $REPO && python3 $HERE/apply_link_fix.py $WINNER && grep -n "stdc" setup.py
    python3 -m pip install -v --no-build-isolation --no-deps --no-input . > $R/install-fix.log 2>&1; el "install with $WINNER rc=$?"
    readelf -d $(python3 -c 'import fastformer._C as c; print(c.__file__)' 2>/dev/null) | grep NEEDED | sed 's/.*\[//; s/\]//' | tr '\n' ' '; echo
    cd /tmp/w
    timeout $(left 90) python3 $REPO/benchmarks/extension_error_probe.py --no-toy > $R/extension_errors-fix.log 2>&1; el "probe with $WINNER rc=$?"; grep -v "^\s" $R/extension_errors-fix.log | cut -c1-200
    pack
    timeout $(left 150) python3 -m pytest $REPO/tests/test_extension.py $REPO/tests/test_alignment.py -q -ra -n 8 -p no:cacheprovider > $R/pytest-fix.log 2>&1; el "extension tests with $WINNER rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest-fix.log | tail -8 | cut -c1-250
fi
pack
el done
