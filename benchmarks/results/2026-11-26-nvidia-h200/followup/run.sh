export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PIP_BREAK_SYSTEM_PACKAGES=1
REPO=$PWD
(python3 -m pip install --no-build-isolation --no-deps --no-input . > $OUT/install.log 2>&1; echo "install rc=$?" >> $OUT/install.log) &
PYTHONPATH=$REPO timeout 60 python3 benchmarks/kernels.py --quick --ops residual_layer_norm --out-dir /tmp/k > $OUT/ln_alone.log 2>&1; echo "ln alone rc=$?"; tail -12 $OUT/ln_alone.log | cut -c1-200
PYTHONPATH=$REPO timeout 40 python3 .gpu_diag/ce_diag.py 2>&1 | tail -8
wait; tail -2 $OUT/install.log
cd /tmp && timeout 60 python3 -X faulthandler $REPO/.gpu_diag/ext_diag.py > $OUT/ext_diag.log 2>&1; echo "ext diag rc=$?"; tail -25 $OUT/ext_diag.log | cut -c1-300
cd /tmp && timeout 90 python3 -m pytest -p no:cacheprovider -q -ra -n 6 $REPO/tests/test_extension.py $REPO/tests/test_captured_step.py $REPO/tests/test_attention_kernel.py::test_short_path_is_one_forward_and_one_backward_kernel $REPO/tests/test_cross_entropy_kernel.py::test_fp32_out_matmul_decision $REPO/tests/test_model_fused.py $REPO/tests/test_layernorm_kernel.py::test_module_under_autocast_same_dtypes_and_values_on_both_backends -k "not low_precision" > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | cut -c1-200 | tail -15
cd /tmp && PYTHONPATH= timeout 40 python3 -m pytest -p no:cacheprovider -q -x $REPO/tests/test_beam_search.py -k non_finite > $OUT/nonfinite.log 2>&1; echo "nonfinite rc=$?"; tail -25 $OUT/nonfinite.log | cut -c1-300
