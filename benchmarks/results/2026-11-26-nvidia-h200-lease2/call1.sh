set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PIP_BREAK_SYSTEM_PACKAGES=1
REPO=$PWD
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
(cd /tmp && timeout 240 python3 $REPO/.gpu_diag/ext_exp.py > $OUT/ext_exp.log 2>&1; echo "rc=$?" >> $OUT/ext_exp.log) &
EXP=$!
{ c++ --version | head -1; nvcc --version | tail -2; python3 -c "import torch; print(torch.__version__, torch.version.cuda, 'cxx11abi', torch._C._GLIBCXX_USE_CXX11_ABI)"; python3 -c "import triton; print('triton', triton.__version__)"; python3 -c "import pybind11; print('pybind11', pybind11.__version__)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $OUT/environment.txt 2>&1
cat $OUT/environment.txt
python3 -m pip install -v --no-build-isolation --no-deps --no-input . > $OUT/install.log 2>&1; el "install rc=$?"
cd /tmp
timeout 100 python3 $REPO/benchmarks/extension_error_probe.py > $OUT/extension_errors.log 2>&1; el "probe rc=$?"; grep -v "^\s" $OUT/extension_errors.log | tail -6 | cut -c1-250
timeout 60 gdb -q -batch -ex run -ex "bt 40" --args python3 -c "import torch, fastformer._C; torch.ops.fastformer.cross_attention(torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1)" > $OUT/gdb.log 2>&1; el "gdb rc=$?"; grep -E "^#|SIG" $OUT/gdb.log | head -24 | cut -c1-220
timeout 220 python3 -m pytest $REPO/tests -m gpu -q -ra -n 8 -p no:cacheprovider --junitxml=$OUT/pytest-gpu-marked.xml > $OUT/pytest-gpu-marked.log 2>&1; el "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest-gpu-marked.log | tail -12 | cut -c1-250
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 $REPO/.gpu_diag/memcheck_options.py > $OUT/memcheck_options.log 2>&1; el "memcheck rc=$?"; tail -3 $OUT/memcheck_options.log | cut -c1-200
cd $REPO && timeout 60 python3 benchmarks/kernels.py --quick --ops residual_layer_norm --out-dir $OUT/kernels_ln > $OUT/kernels_ln.log 2>&1; el "ln rc=$?"; grep -E "^(residual|copy)|layer" $OUT/kernels_ln.log | cut -c1-200 | head -12
cd /tmp && timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 $REPO/tests/test_cross_entropy_kernel.py -k "gradient_from_forward or overwrite" > $OUT/ce.log 2>&1; el "ce rc=$?"; tail -2 $OUT/ce.log | cut -c1-200
wait $EXP; cat $OUT/ext_exp.log | cut -c1-200 | tail -20
el done
