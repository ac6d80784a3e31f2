# The second call, from the repository root: bash benchmarks/results/2026-11-27-nvidia-h200/call2.sh
# setup.py as committed (the C++ library linked in); logs into /tmp/r, packed into $OUT/call2.tar.gz.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PIP_BREAK_SYSTEM_PACKAGES=1
REPO=$PWD; R=/tmp/r; mkdir -p $R /tmp/w
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
pack() { tar czf $OUT/call2.tar.gz -C /tmp r; }
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400 > $R/lscpu.txt; cat $R/lscpu.txt | cut -c1-200
python3 -m pip install -v --no-build-isolation --no-deps --no-input . > $R/install.log 2>&1; el "install rc=$?"
readelf -d /opt/torch/.venv/lib/python3.12/site-packages/fastformer/_C*.so | grep NEEDED | sed 's/.*\[//; s/\]//' | tr '\n' ' '; echo
cd /tmp/w
timeout 60 python3 $REPO/benchmarks/extension_error_probe.py --no-toy > $R/extension_errors.log 2>&1; el "probe rc=$?"; grep -v "^\s" $R/extension_errors.log | cut -c1-160
for threads in 1 2 16; do
  OMP_NUM_THREADS=$threads timeout 60 python3 -m pytest -q -p no:cacheprovider "$REPO/tests/test_alignment.py::test_attention_does_not_depend_on_the_batch" > $R/alignment-batch-$threads.log 2>&1; el "alignment batch test, $threads threads: $(tail -1 $R/alignment-batch-$threads.log)"
done
pack
timeout 200 python3 -m pytest -q -ra -n 8 -p no:cacheprovider $REPO/tests/test_extension.py $REPO/tests/test_beam_search.py $REPO/tests/test_scoring.py $REPO/tests/test_search_options.py $REPO/tests/test_alignment.py > $R/pytest-decoding.log 2>&1; el "decoding tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest-decoding.log | tail -10 | cut -c1-220
pack; el done
