"""Compiles every Triton kernel launch of the fused ops for NVIDIA GPUs ahead of time, with no GPU present.

Run without TRITON_INTERPRET (test_triton_aot.py starts it in a subprocess). The host launchers run on CPU tensors as
they would on a GPU (the attention launcher is told it is not interpreted), but every launch, plain or autotuned, is
recorded instead of run. Each recorded kernel, with the argument types, constexprs and every autotune config it was
launched with, is then compiled down to a cubin for each target by Triton's own compiler and ptxas; the shared
memory each needs is checked against what one block may use on that GPU. This proves on a CPU what the GPU would
otherwise find first: a kernel or config that does not compile, or does not fit.

The compiles are independent, so they run in parallel, one process per core (ptxas and Triton's passes are single
threaded). Triton's cache (TRITON_CACHE_DIR) keys each compiled kernel by a hash of everything that goes into it:
the kernel's source and the source of every function it calls, the argument types, constexprs and options, the
target, the Triton and ptxas versions. A cache hit is therefore the same compile done earlier, and its stored
metadata (shared memory) and cubin are what compiling again would give.

    python tests/triton_aot.py [--targets 90,80] [--quick] [--jobs N]   # prints one JSON line: the compiled launches
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import sys
import time
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

# Largest shared memory one block may use (opt-in), in bytes: H100 (sm_90) 227 KiB, A100 (sm_80) 163 KiB.
SHARED_MEMORY_LIMIT = {90: 232448, 80: 166912}
TYPE_CODES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
              torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}


def _type_code(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPE_CODES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


class Recorder:
    """Replaces kernel launches by a record of (kernel, signature, constexprs, options) per distinct launch."""

    def __init__(self) -> None:
        self.launches: dict[str, tuple[JITFunction, dict, dict, dict]] = {}

    def record(self, kernel: JITFunction, args: tuple, kwargs: dict, config: triton.Config | None) -> None:
        options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
        if config is not None:
            kwargs = {**kwargs, **config.kwargs}
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        bound = inspect.signature(kernel.fn).bind(*args, **kwargs).arguments
        signature, constexprs = {}, {}
        for param in kernel.params:
            value = bound[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                signature[param.name] = _type_code(value)
        key = json.dumps([kernel.fn.__name__, signature, {k: str(v) for k, v in constexprs.items()}, options])
        self.launches[key] = (kernel, signature, constexprs, options)

    def install(self) -> None:
        recorder = self

        def jit_run(kernel, *args, grid, warmup, **kwargs):
            recorder.record(kernel, args, kwargs, None)

        def autotuned_run(tuner, *args, **kwargs):
            for name in ("grid", "warmup"):
                kwargs.pop(name, None)
            for config in tuner.configs:
                recorder.record(tuner.fn, args, dict(kwargs), config)

        JITFunction.run = jit_run
        Autotuner.run = autotuned_run


def run_every_launcher(quick: bool) -> None:
    """Forward and backward of each fused op over the dtypes and flags whose kernels differ."""
    import triton_kernels.attention as attention
    from triton_kernels.cross_entropy import cross_entropy, linear_cross_entropy
    from triton_kernels.layernorm_residual import residual_layer_norm

    attention._interpreted = lambda device: False
    attention.SHORT_PATH_ON_GPU = True  # compile the short path too, though GPUs take it only when asked
    dtypes = (torch.float16, torch.float32) if quick else (torch.float16, torch.bfloat16, torch.float32)
    for dtype in dtypes:
        for head_dim in ((64,) if quick else (64, 128)):
            # The longest sequence of the short path (its largest tile: the one that could run out of shared
            # memory), and one past its bound for the long path.
            longest_short = min(attention.SHORT_PATH_MAX_LEN,
                                attention.SHORT_PATH_TILE_BYTES // (head_dim * dtype.itemsize))
            for length in (longest_short, attention.SHORT_PATH_MAX_LEN + 72):
                for masked in (False, True):
                    q, k, v = (torch.randn(2, length, 2, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
                    lengths = torch.tensor([length, 17]) if masked else None
                    out = attention.flash_attention(q, k, v, q_lengths=lengths, k_lengths=lengths, causal=masked,
                                                    dropout_p=0.1 if masked else 0.0, check_lengths=False)
                    out.backward(torch.randn_like(out))
        attention.attention_dropout_mask(3, 1, 1, 4, 4, 0.1)

        # Cross-entropy: loss alone; loss and gradient in one launch, then backward's recomputing (own buffer) or
        # scaling (over the logits) launch; linear + CE with gradients in forward, and with reduction "none"
        # (recomputed in backward).
        logits = torch.randn(8, 1000, dtype=dtype, requires_grad=True)
        target = torch.randint(0, 1000, (8,))
        with torch.no_grad():
            cross_entropy(logits, target, label_smoothing=0.1, check_targets=False)
        cross_entropy(logits, target, label_smoothing=0.1, check_targets=False).backward()
        cross_entropy(logits * 1.0, target, label_smoothing=0.1, overwrite_logits=True,
                      check_targets=False).backward()
        hidden = torch.randn(8, 64, dtype=dtype, requires_grad=True)
        weight = torch.randn(1000, 64, dtype=dtype, requires_grad=True)
        for reduction in ("mean", "none"):
            loss = linear_cross_entropy(hidden, weight, target, label_smoothing=0.1, reduction=reduction,
                                        check_targets=False)
            loss.backward(torch.ones_like(loss))
        # The transformer presets' widths and the widest row the kernel takes (one-row tiles, 16 warps).
        for d_model in ((512,) if quick else (512, 1024, 8192)):
            x, residual = (torch.randn(4, 5, d_model, dtype=dtype, requires_grad=True) for _ in range(2))
            norm_weight, norm_bias = (torch.randn(d_model, dtype=dtype, requires_grad=True) for _ in range(2))
            # Pre-LN: both outputs used.
            y, s = residual_layer_norm(x, residual, norm_weight, norm_bias, dropout_p=0.1)
            (y.sum() + s.sum()).backward()
        # Post-LN: y only; a pre-LN block's first norm: no residual, no dropout.
        residual_layer_norm(x[..., :512], residual[..., :512], norm_weight[:512], norm_bias[:512],
                            dropout_p=0.1)[0].sum().backward()
        residual_layer_norm(x[..., :512], None, norm_weight[:512], norm_bias[:512])[0].sum().backward()


def _compile(task: tuple[int, int]) -> dict:
    """Compiles launch number `task[0]` of the recorder being compiled for compute capability `task[1]`."""
    index, capability = task
    kernel, signature, constexprs, options = _LAUNCHES_TO_COMPILE[index]
    started = time.perf_counter()
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    shared = compiled.metadata.shared
    return {"kernel": kernel.fn.__name__, "sm": capability, "options": options,
            "constexprs": {k: str(v) for k, v in constexprs.items()},
            "shared_bytes": shared, "fits": shared <= SHARED_MEMORY_LIMIT[capability],
            "cubin_bytes": len(compiled.asm["cubin"]), "seconds": round(time.perf_counter() - started, 3)}


# The launches compile_all hands to its worker processes, which inherit it by fork (JIT functions do not pickle).
_LAUNCHES_TO_COMPILE: list[tuple[JITFunction, dict, dict, dict]] = []


def compile_all(recorder: Recorder, targets: list[int], jobs: int) -> list[dict]:
    """Every recorded launch for every target, `jobs` compiles at a time; a progress line per compile on stderr."""
    _LAUNCHES_TO_COMPILE[:] = recorder.launches.values()
    tasks = [(index, capability) for index in range(len(_LAUNCHES_TO_COMPILE)) for capability in targets]
    results = []
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for result in pool.imap_unordered(_compile, tasks):
            results.append(result)
            print(f"[{len(results)}/{len(tasks)}] sm_{result['sm']} {result['kernel']} {result['seconds']:.1f} s",
                  file=sys.stderr, flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="90,80", help="compute capabilities, comma-separated")
    parser.add_argument("--quick", action="store_true", help="fp16/fp32 and one head_dim / d_model only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles run at once (default: all cores)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET=1: the interpreter compiles nothing")
    recorder = Recorder()
    recorder.install()
    run_every_launcher(args.quick)
    print(json.dumps(compile_all(recorder, [int(t) for t in args.targets.split(",")], args.jobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
