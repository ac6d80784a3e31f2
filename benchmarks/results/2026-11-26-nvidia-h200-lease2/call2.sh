set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PIP_BREAK_SYSTEM_PACKAGES=1
REPO=$PWD
R=/tmp/r; mkdir -p $R
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -v --no-build-isolation --no-deps --no-input . > $R/install.log 2>&1; el "install rc=$?"
cd /tmp
timeout 100 python3 $REPO/benchmarks/extension_error_probe.py > $R/extension_errors.log 2>&1; el "probe rc=$?"; grep -v "^\s" $R/extension_errors.log | tail -4 | cut -c1-200
timeout 200 python3 -m pytest -q -ra -n 8 -p no:cacheprovider $REPO/tests/test_extension.py $REPO/tests/test_beam_search.py $REPO/tests/test_scoring.py $REPO/tests/test_search_options.py $REPO/tests/test_alignment.py --junitxml=$R/pytest-decoding.xml > $R/pytest-decoding.log 2>&1; el "decoding tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest-decoding.log | tail -12 | cut -c1-250
cd $REPO && timeout 60 python3 benchmarks/kernels.py --ops residual_layer_norm --out-dir $R/kernels_ln > $R/kernels_ln.log 2>&1; el "ln rc=$?"; grep -E "^(residual|copy)|LayerNorm" $R/kernels_ln.log | cut -c1-160 | head -14
B=$(( 400 - ($(date +%s) - T0) ))
cd $REPO && timeout $(( B + 30 )) python3 benchmarks/throughput.py --infer --quick --preset base --out-dir $R/infer --time-budget-s $B > $R/infer.log 2>&1; el "infer rc=$?"; tail -22 $R/infer.log | cut -c1-200
tar czf $OUT/run2.tar.gz -C /tmp r; el done
