"""Every Triton kernel launch compiles to a cubin for the H100 (sm_90) and A100 (sm_80) and fits in shared memory.

The interpreter, which the other CPU tests use, compiles nothing; this runs Triton's real compiler (with ptxas) in a
subprocess without TRITON_INTERPRET, over the launches the host code makes (see triton_aot.py), on every core.
Compiled kernels are kept in build/triton-aot-cache: Triton keys them by a hash of all their inputs, so a later run
recompiles exactly the launches whose kernel source, arguments, options or compiler changed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_kernels.attention import _LAUNCHES

SCRIPT = Path(__file__).with_name("triton_aot.py")
CACHE_DIR = Path(__file__).resolve().parents[1] / "build" / "triton-aot-cache"
KERNELS = {"_flash_attention_fwd_kernel", "_flash_attention_bwd_preprocess_kernel",
           "_flash_attention_bwd_dkdv_kernel", "_flash_attention_bwd_dq_kernel", "_short_attention_fwd_kernel",
           "_short_attention_bwd_kernel", "_dropout_mask_kernel",
           "_cross_entropy_kernel", "_residual_layer_norm_fwd_kernel", "_residual_layer_norm_bwd_kernel",
           "_sum_partials_kernel", "_scale_rows_kernel"}


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile and run every kernel")
@pytest.mark.parametrize("capability, quick", [(90, False), (80, True)])
def test_every_kernel_compiles_for_the_gpu_and_fits_in_shared_memory(capability, quick):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    # This test's own cache: nothing else compiles into it, and a hit is the same compile done by an earlier run.
    env["TRITON_CACHE_DIR"] = str(CACHE_DIR)
    command = [sys.executable, str(SCRIPT), "--targets", str(capability), *(["--quick"] if quick else [])]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads(completed.stdout.splitlines()[-1])
    assert {result["kernel"] for result in results} == KERNELS
    too_big = [result for result in results if not result["fits"]]
    assert not too_big, too_big
    assert all(result["cubin_bytes"] > 0 for result in results)
    # Every tile the attention launcher can pick (each autotune config, and the fp32 tile) was compiled.
    kernel_names = {"forward": "_flash_attention_fwd_kernel", "dkdv": "_flash_attention_bwd_dkdv_kernel",
                    "dq": "_flash_attention_bwd_dq_kernel"}
    for name, launch in _LAUNCHES.items():
        expected = {tile(config.kwargs, config.num_warps, config.num_stages)
                    for config in (*launch.tuned.configs, launch.fp32_config)}
        compiled = {tile(result["constexprs"], result["options"]["num_warps"], result["options"]["num_stages"])
                    for result in results if result["kernel"] == kernel_names[name]}
        assert compiled == expected, name


def tile(constexprs: dict, num_warps: int, num_stages: int) -> tuple[int, ...]:
    return int(constexprs["BLOCK_M"]), int(constexprs["BLOCK_N"]), num_warps, num_stages
