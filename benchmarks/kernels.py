"""Each fused op against its PyTorch counterparts over transformer-base/-big shapes, with the project's speed targets.

    python benchmarks/kernels.py                    # on the GPU, bf16
    python benchmarks/kernels.py --device cpu       # tiny fp32 shapes in Triton's interpreter: a smoke run only

The fused ops are called through fastformer.dispatch under the "triton" backend, which refuses inputs its kernels do
not take (so the reference can never be timed as the kernel), as the training step calls them: with
check_lengths=False / check_targets=False, since the step checks its batch once. Timing: every system, fused and
PyTorch alike, by CUDA-graph replay (triton.testing.do_bench_cudagraph: many calls captured in one graph, so no
system pays the host's launch overhead; median and 20th/80th percentiles of the replays; a backward timed alone
is captured the same way, on the stream of its forward); wall clock around
synchronize on CPU. Peak memory: the most allocated during one call above what was allocated before it (inputs
excluded, outputs and gradients included).

- attention: forward and forward+backward on WMT-like padded batches (lengths within a batch spread over the upper
  40% of its longest, as length-sorted batching leaves them) of encoder self-, decoder causal self- and
  cross-attention, at longest lengths 16 to 256 and ~16k tokens a batch, with the base (8 heads) and big (16 heads)
  presets' heads, against F.scaled_dot_product_attention given the same boolean mask (each row names the SDPA
  backend that ran); and on unpadded equal-length batches against SDPA's flash backend. TFLOP/s count the real
  (unpadded, causal half) query-key pairs, 4 * head_dim FLOPs each forward, 3.5x that forward+backward
  (flash-attention's convention).
- cross_entropy: label smoothing 0.1, ~10% ignored targets, vs F.cross_entropy; time and peak memory.
- linear_cross_entropy: hidden @ weight.T + CE vs F.linear + F.cross_entropy; time, and peak memory against the
  logits' size.
- residual_layer_norm: LayerNorm(residual + dropout(x)), p = 0.1, vs add + F.dropout + F.layer_norm; GB/s of the
  minimal traffic (read x and residual, write y and s; backward: read dy and s, write dx and dresidual) against a
  device-to-device copy's GB/s (2 x bytes copied / time).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import bench_utils as bu
import fastformer
from fastformer import dispatch

# The targets (transformer-base, H100, bf16).
TARGET_ATTENTION_SPEEDUP = 2.0  # forward+backward vs SDPA with the same mask, padded batches
TARGET_ATTENTION_FLASH_SPEEDUP = 1.0  # forward+backward vs SDPA's flash backend, unpadded equal lengths
TARGET_CE_SPEEDUP = 2.0
TARGET_CE_MEMORY_RATIO = 0.5
TARGET_LINEAR_CE_LOGITS_RATIO = 0.25
TARGET_LINEAR_CE_SPEEDUP = 1.0  # fwd+bwd vs F.linear + F.cross_entropy: no slower than unfused
TARGET_LAYER_NORM_COPY_RATIO = 0.8

PRESET_HEADS = {"base": (512, 8), "big": (1024, 16)}  # d_model, heads (head_dim 64)
ATTENTION_MAX_LENS = (16, 32, 64, 128, 256)
ATTENTION_BATCH_TOKENS = 16384
LABEL_SMOOTHING = 0.1
LAYER_NORM_DROPOUT = 0.1
PAD_ID = 0


class Bench:
    """Times and measures callables on one device; quick mode trades precision for time."""

    def __init__(self, device: torch.device, quick: bool) -> None:
        self.device = device
        self.quick = quick

    def time_ms(self, fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> dict:
        """-> {median, p20, p80} in milliseconds."""
        if self.device.type == "cuda":
            from triton.testing import do_bench_cudagraph
            median, p20, p80 = do_bench_cudagraph(fn, rep=20 if self.quick else 100, grad_to_none=grad_to_none,
                                                  quantiles=[0.5, 0.2, 0.8])
            return {"median": median, "p20": p20, "p80": p80}

        def call() -> None:
            for tensor in grad_to_none or []:
                tensor.grad = None
            fn()

        times = sorted(1000 * t for t in bu.time_calls(call, self.device, warmup=1, repeats=3))
        return {"median": times[1], "p20": times[0], "p80": times[-1]}

    def time_backward_ms(self, forward: Callable[[], object], backward: Callable[[object], object]) -> dict:
        """-> {median, p20, p80} in milliseconds of backward(forward()), the forward not timed. Autograd runs each
        backward op on the stream of its forward op, so on CUDA the forward runs on the stream the backward is
        captured on: a backward of a forward made elsewhere would leave the capture, which breaks it (and leaves
        torch's generator in capture state, failing every later random draw)."""
        if self.device.type != "cuda":
            state = forward()
            return self.time_ms(lambda: backward(state))
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            state = forward()
            backward(state)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            events[0].record()
            for _ in range(5):
                backward(state)
            events[1].record()
            torch.cuda.synchronize()
            # As do_bench_cudagraph: enough calls in one graph to fill the replay time asked for.
            n_calls = max(1, int((20 if self.quick else 100) / max(events[0].elapsed_time(events[1]) / 5, 1e-3)))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(n_calls):
                    backward(state)
            times = []
            for _ in range(10):
                events[0].record()
                graph.replay()
                events[1].record()
                torch.cuda.synchronize()
                times.append(events[0].elapsed_time(events[1]) / n_calls)
        median, p20, p80 = torch.quantile(torch.tensor(times), torch.tensor([0.5, 0.2, 0.8])).tolist()
        return {"median": median, "p20": p20, "p80": p80}

    def peak_extra_bytes(self, fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> int | None:
        """Most bytes allocated during one call above those allocated before it (None on CPU)."""
        if self.device.type != "cuda":
            return None
        for tensor in grad_to_none or []:
            tensor.grad = None
        before = bu.reset_peak_memory(self.device)
        fn()
        peak = bu.peak_memory(self.device)
        for tensor in grad_to_none or []:
            tensor.grad = None
        return peak - before


def row(op: str, case: str, system: str, timing: dict | None, **extra) -> dict:
    return {"op": op, "case": case, "system": system, "ms": timing, "status": "ok", **extra}


def failed(op: str, case: str, system: str, error: str) -> dict:
    return {"op": op, "case": case, "system": system, "ms": None, "status": "error", "error": error[:300]}


def guarded(op: str, case: str, system: str, measure: Callable[[], dict]) -> dict:
    """Runs one measurement; an exception becomes an error row so the other measurements still run."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - reported in the results
        return failed(op, case, system, f"{type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------------------------------------
# Attention


def padded_lengths(batch: int, max_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch] lengths in [0.6 * max_len, max_len], the longest exactly max_len (a length-sorted bucket)."""
    low = max(1, math.ceil(0.6 * max_len))
    lengths = torch.randint(low, max_len + 1, (batch,), generator=generator)
    lengths[0] = max_len
    return lengths


def attention_cases(device: torch.device, quick: bool) -> list[dict]:
    """(preset, kind, batch, q/k lengths) for the sweep; tiny shapes on CPU."""
    if device.type == "cpu":
        presets, max_lens, tokens, dims = ["tiny"], [16], 32, {"tiny": (64, 2)}
    else:
        presets, tokens, dims = ["base", "big"], ATTENTION_BATCH_TOKENS, PRESET_HEADS
        max_lens = [64] if quick else ATTENTION_MAX_LENS
    generator = torch.Generator().manual_seed(0)
    cases = []
    for preset in presets:
        d_model, heads = dims[preset]
        for max_len in max_lens:
            batch = tokens // max_len
            for kind in ("encoder", "decoder-causal", "cross"):
                q_lengths = padded_lengths(batch, max_len, generator)
                k_lengths = q_lengths if kind != "cross" else padded_lengths(batch, max_len, generator)
                cases.append(dict(preset=preset, kind=kind, batch=batch, max_len=max_len, heads=heads,
                                  head_dim=d_model // heads, q_lengths=q_lengths, k_lengths=k_lengths))
    return cases


def attention_flops(q_lengths: torch.Tensor, k_lengths: torch.Tensor, heads: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs over the real query-key pairs (the causal half where causal)."""
    if causal:
        pairs = (q_lengths * (q_lengths + 1) // 2).sum()
    else:
        pairs = (q_lengths * k_lengths).sum()
    return 4.0 * heads * head_dim * float(pairs)


def sdpa_keep_mask(q_lengths: torch.Tensor, k_lengths: torch.Tensor, q_len: int, k_len: int, causal: bool,
                   device: torch.device) -> torch.Tensor:
    """[batch, 1, q_len, k_len] bool, True where a query may attend (SDPA's convention)."""
    keep = (torch.arange(k_len, device=device)[None, :] < k_lengths.to(device)[:, None])[:, None, None, :]
    if causal:
        keep = keep & torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()[None, None]
    return keep.expand(-1, 1, q_len, -1)


def attention_rows(bench: Bench, dtype: torch.dtype) -> list[dict]:
    from triton_kernels.attention import attention_path
    device = bench.device
    rows = []
    for case in attention_cases(device, bench.quick):
        causal = case["kind"] == "decoder-causal"
        batch, max_len, heads, head_dim = case["batch"], case["max_len"], case["heads"], case["head_dim"]
        # Which of the kernel's paths runs: a function of the padded sizes alone, the same for padded and not.
        path = attention_path(max_len, max_len, head_dim, dtype)
        name = f"{case['preset']} {case['kind']} B={batch} L<={max_len} ({path} path)"
        for padded in (True, False):
            q_lengths = case["q_lengths"] if padded else torch.full((batch,), max_len)
            k_lengths = case["k_lengths"] if padded else torch.full((batch,), max_len)
            q, k, v = (torch.randn(batch, max_len, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            grad_out = torch.randn_like(q)
            flops = attention_flops(q_lengths, k_lengths, heads, head_dim, causal)
            label = name if padded else f"{case['preset']} {case['kind']} B={batch} L={max_len} unpadded ({path} path)"
            lengths = (q_lengths.to(device), k_lengths.to(device)) if padded else (None, None)

            def fused() -> torch.Tensor:
                with fastformer.backend("triton"):
                    return dispatch.attention(q, k, v, q_lengths=lengths[0], k_lengths=lengths[1], causal=causal,
                                              check_lengths=False)

            if padded:
                mask = sdpa_keep_mask(q_lengths, k_lengths, max_len, max_len, causal, device)

                def baseline() -> torch.Tensor:
                    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=mask)
                    return out.transpose(1, 2)
                backend = sdpa_backend_name(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, False)
                baseline_name = f"sdpa (mask, {backend})"
            else:
                def baseline() -> torch.Tensor:
                    with flash_backend(device):
                        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=causal)
                    return out.transpose(1, 2)
                with flash_backend(device):
                    backend = sdpa_backend_name(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                                causal)
                baseline_name = f"sdpa ({backend})"

            for direction in ("fwd", "fwd+bwd"):
                scale = 1.0 if direction == "fwd" else 3.5
                measured = {}
                for system, fn in (("fastformer", fused), (baseline_name, baseline)):
                    call = fn if direction == "fwd" else (lambda fn=fn: fn().backward(grad_out))
                    result = guarded("attention", f"{label} {direction}", system, lambda: row(
                        "attention", f"{label} {direction}", system,
                        bench.time_ms(call, grad_to_none=[q, k, v] if direction != "fwd" else None)))
                    if result["status"] == "ok":
                        result["tflops"] = scale * flops / (result["ms"]["median"] * 1e-3) / 1e12
                        measured[system] = result
                    rows.append(result)
                fast, slow = measured.get("fastformer"), measured.get(baseline_name)
                if fast and slow:
                    goal = TARGET_ATTENTION_SPEEDUP if padded else TARGET_ATTENTION_FLASH_SPEEDUP
                    compare_to_baseline(fast, slow, baseline_name, goal if direction == "fwd+bwd" else None)
                    fast["padded"] = padded
                    fast["path"] = path
            del q, k, v, grad_out
    return rows


def compare_to_baseline(fast: dict, slow: dict, baseline: str, goal: float | None) -> None:
    """Adds to the fused system's row its speedup over the baseline's row and, with a goal, the goal and verdict."""
    fast["speedup"] = slow["ms"]["median"] / fast["ms"]["median"]
    fast["vs"] = baseline
    if goal is not None:
        fast["goal"] = goal
        fast["verdict"] = bu.verdict(fast["speedup"], goal)


def sdpa_backend_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool) -> str:
    """The backend F.scaled_dot_product_attention picks for q, k, v: [batch, heads, len, head_dim] under the
    current sdpa_kernel restriction (torch's own dispatcher answers, without running it)."""
    from torch.nn.attention import SDPBackend
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, causal)
    return SDPBackend(choice).name.lower()


def flash_backend(device: torch.device):
    """SDPA restricted to its flash kernel on CUDA; any backend on CPU."""
    from contextlib import nullcontext
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


# ---------------------------------------------------------------------------------------------------------------------
# Cross-entropy and fused linear + cross-entropy


def ce_targets(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    target = torch.randint(3, vocab, (n,), generator=generator)
    target[torch.rand(n, generator=generator) < 0.1] = PAD_ID
    return target.to(device)


def cross_entropy_rows(bench: Bench, dtype: torch.dtype) -> list[dict]:
    device = bench.device
    sizes = [(64, 1000)] if device.type == "cpu" else [(8192, bu.WMT_VOCAB)] + ([] if bench.quick
                                                                               else [(16384, bu.WMT_VOCAB)])
    rows = []
    for n, vocab in sizes:
        logits = torch.randn(n, vocab, device=device, dtype=dtype, requires_grad=True)
        target = ce_targets(n, vocab, device)

        def fused() -> torch.Tensor:
            with fastformer.backend("triton"):
                return dispatch.cross_entropy(logits, target, ignore_index=PAD_ID, label_smoothing=LABEL_SMOOTHING,
                                              check_targets=False)

        def torch_ce() -> torch.Tensor:
            return F.cross_entropy(logits, target, ignore_index=PAD_ID, label_smoothing=LABEL_SMOOTHING)

        for direction in ("fwd", "fwd+bwd"):
            case = f"N={n} V={vocab} {direction}"
            measured = {}
            for system, fn in (("fastformer", fused), ("F.cross_entropy", torch_ce)):
                call = fn if direction == "fwd" else (lambda fn=fn: fn().backward())
                grads = [logits] if direction != "fwd" else None

                def measure(system=system, call=call, grads=grads) -> dict:
                    timing = bench.time_ms(call, grad_to_none=grads)
                    return row("cross_entropy", case, system, timing,
                               peak_extra_mib=mib(bench.peak_extra_bytes(call, grad_to_none=grads)))
                result = guarded("cross_entropy", case, system, measure)
                if result["status"] == "ok":
                    measured[system] = result
                rows.append(result)
            fast, slow = measured.get("fastformer"), measured.get("F.cross_entropy")
            if fast and slow:
                compare_to_baseline(fast, slow, "F.cross_entropy", TARGET_CE_SPEEDUP)
                if fast["peak_extra_mib"] is not None and direction == "fwd+bwd":
                    fast["memory_ratio"] = fast["peak_extra_mib"] / slow["peak_extra_mib"]
                    fast["memory_goal"] = TARGET_CE_MEMORY_RATIO
                    fast["memory_verdict"] = bu.verdict(fast["memory_ratio"], TARGET_CE_MEMORY_RATIO,
                                                        higher_is_better=False)
        del logits
    return rows


def mib(n_bytes: int | None) -> float | None:
    return None if n_bytes is None else n_bytes / 2**20


def linear_cross_entropy_rows(bench: Bench, dtype: torch.dtype) -> list[dict]:
    device = bench.device
    if device.type == "cpu":
        sizes = [("tiny", 64, 64, 1000)]
    else:
        sizes = [("base", 8192 if bench.quick else 16384, 512, bu.WMT_VOCAB)]
        sizes += [] if bench.quick else [("big", 16384, 1024, bu.WMT_VOCAB)]
    rows = []
    for preset, n, d, vocab in sizes:
        hidden = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(vocab, d, device=device, dtype=dtype) * d ** -0.5).requires_grad_()
        target = ce_targets(n, vocab, device)
        logits_mib = n * vocab * torch.finfo(dtype).bits / 8 / 2**20

        def fused() -> torch.Tensor:
            with fastformer.backend("triton"):
                return dispatch.linear_cross_entropy(hidden, weight, target, ignore_index=PAD_ID,
                                                     label_smoothing=LABEL_SMOOTHING, check_targets=False)

        def unfused() -> torch.Tensor:
            return F.cross_entropy(F.linear(hidden, weight), target, ignore_index=PAD_ID,
                                   label_smoothing=LABEL_SMOOTHING)

        case = f"{preset} N={n} d={d} V={vocab} fwd+bwd"
        measured = {}
        for system, fn in (("fastformer", fused), ("F.linear + F.cross_entropy", unfused)):
            def measure(fn=fn, system=system) -> dict:
                call = lambda: fn().backward()  # noqa: E731
                timing = bench.time_ms(call, grad_to_none=[hidden, weight])
                peak = mib(bench.peak_extra_bytes(call, grad_to_none=[hidden, weight]))
                result = row("linear_cross_entropy", case, system, timing, peak_extra_mib=peak, logits_mib=logits_mib)
                if peak is not None:
                    result["logits_ratio"] = peak / logits_mib
                    if system == "fastformer":
                        result["memory_goal"] = TARGET_LINEAR_CE_LOGITS_RATIO
                        result["memory_verdict"] = bu.verdict(result["logits_ratio"], TARGET_LINEAR_CE_LOGITS_RATIO,
                                                              higher_is_better=False)
                return result
            result = guarded("linear_cross_entropy", case, system, measure)
            if result["status"] == "ok":
                measured[system] = result
            rows.append(result)
        fast, slow = measured.get("fastformer"), measured.get("F.linear + F.cross_entropy")
        if fast and slow:
            compare_to_baseline(fast, slow, "F.linear + F.cross_entropy", TARGET_LINEAR_CE_SPEEDUP)
        del hidden, weight
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Residual LayerNorm


def layer_norm_rows(bench: Bench, dtype: torch.dtype) -> list[dict]:
    device = bench.device
    shapes = [(256, 64)] if device.type == "cpu" else [(32768, 512), (32768, 1024)]
    element = torch.finfo(dtype).bits // 8
    rows = []
    for n_rows, d in shapes:
        x = torch.randn(n_rows, d, device=device, dtype=dtype, requires_grad=True)
        residual = torch.randn(n_rows, d, device=device, dtype=dtype, requires_grad=True)
        weight = torch.ones(d, device=device, dtype=dtype, requires_grad=True)
        bias = torch.zeros(d, device=device, dtype=dtype, requires_grad=True)
        tensor_bytes = n_rows * d * element
        # The traffic any implementation must move: forward reads x, residual and writes y, s; backward (post-LN,
        # y's gradient only) reads dy, s and writes dx, dresidual. Left out, so that they count against the kernel:
        # the fp32 row statistics (8 bytes a row each way) and the backward's fp32 dweight/dbias partial sums
        # (8 * D bytes per backward program, written then read again: 2 * programs / n_rows of the counted traffic,
        # with as many programs as the GPU holds at once).
        traffic = 4 * tensor_bytes
        case = f"rows={n_rows} D={d}"

        source = torch.empty(n_rows * d * 4, device=device, dtype=dtype)
        target = torch.empty_like(source)
        copy = guarded("copy", case, "device copy", lambda: row(
            "copy", case, "device copy", bench.time_ms(lambda: target.copy_(source))))
        if copy["status"] == "ok":
            copy["gb_s"] = 2 * source.numel() * element / (copy["ms"]["median"] * 1e-3) / 1e9
        rows.append(copy)
        del source, target

        def fused() -> torch.Tensor:
            with fastformer.backend("triton"):
                return dispatch.residual_layer_norm(x, residual, weight, bias, dropout_p=LAYER_NORM_DROPOUT)[0]

        def torch_ln() -> torch.Tensor:
            s = residual + F.dropout(x, LAYER_NORM_DROPOUT)
            return F.layer_norm(s, (d,), weight, bias)

        grad_y = torch.randn(n_rows, d, device=device, dtype=dtype)
        for system, fn in (("fastformer", fused), ("add + dropout + F.layer_norm", torch_ln)):
            for direction in ("fwd", "bwd"):
                def measure(fn=fn, direction=direction, system=system) -> dict:
                    if direction == "fwd":
                        with torch.no_grad():
                            timing = bench.time_ms(fn)
                    else:
                        timing = bench.time_backward_ms(fn, lambda y: torch.autograd.grad(
                            y, [x, residual, weight, bias], grad_y, retain_graph=True))
                    result = row("residual_layer_norm", f"{case} {direction}", system, timing)
                    result["gb_s"] = traffic / (timing["median"] * 1e-3) / 1e9
                    if copy["status"] == "ok":
                        result["copy_ratio"] = result["gb_s"] / copy["gb_s"]
                        if system == "fastformer":
                            result["goal"] = TARGET_LAYER_NORM_COPY_RATIO
                            result["verdict"] = bu.verdict(result["copy_ratio"], TARGET_LAYER_NORM_COPY_RATIO)
                    return result
                rows.append(guarded("residual_layer_norm", f"{case} {direction}", system, measure))
        del x, residual, grad_y
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Summary, outputs


def geometric_mean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets (attention: geometric means over the whole sweep, both presets; the rest at the base
    shapes)."""
    def fused(op: str, predicate: Callable[[dict], bool] = lambda r: True) -> list[dict]:
        return [r for r in rows if r["op"] == op and r["system"] == "fastformer" and r["status"] == "ok"
                and predicate(r)]

    attention = fused("attention", lambda r: "verdict" in r)
    masked = [r["speedup"] for r in attention if r["padded"]]
    flash = [r["speedup"] for r in attention if not r["padded"]]
    ce = fused("cross_entropy", lambda r: r["case"].endswith("fwd+bwd"))
    linear = fused("linear_cross_entropy", lambda r: r["case"].startswith("base"))
    layer_norm = fused("residual_layer_norm", lambda r: "D=512" in r["case"] and "copy_ratio" in r)
    layer_norm_ratio = {direction: [r["copy_ratio"] for r in layer_norm if r["case"].endswith(direction)]
                        for direction in (" fwd", " bwd")}

    def worst(values: list[float], higher_is_better: bool = True) -> float | None:
        return (min(values) if higher_is_better else max(values)) if values else None

    checks = [
        ("attention fwd+bwd vs SDPA (same mask), padded, L<=16..256, 8 and 16 heads: geometric mean",
         geometric_mean(masked), TARGET_ATTENTION_SPEEDUP, True),
        ("attention fwd+bwd vs SDPA's flash backend, unpadded equal lengths: geometric mean", geometric_mean(flash),
         TARGET_ATTENTION_FLASH_SPEEDUP, True),
        ("label-smoothed CE fwd+bwd speedup vs F.cross_entropy (worst size)",
         worst([r["speedup"] for r in ce if "speedup" in r]), TARGET_CE_SPEEDUP, True),
        ("label-smoothed CE peak memory / F.cross_entropy's (worst size)",
         worst([r["memory_ratio"] for r in ce if "memory_ratio" in r], False), TARGET_CE_MEMORY_RATIO, False),
        ("fused linear + CE peak memory / logits memory, base",
         worst([r["logits_ratio"] for r in linear if "logits_ratio" in r], False), TARGET_LINEAR_CE_LOGITS_RATIO,
         False),
        ("fused linear + CE fwd+bwd speedup vs F.linear + F.cross_entropy, base",
         worst([r["speedup"] for r in linear if "speedup" in r]), TARGET_LINEAR_CE_SPEEDUP, True),
        ("residual LayerNorm forward GB/s / copy GB/s, D=512", worst(layer_norm_ratio[" fwd"]),
         TARGET_LAYER_NORM_COPY_RATIO, True),
        ("residual LayerNorm backward GB/s / copy GB/s, D=512", worst(layer_norm_ratio[" bwd"]),
         TARGET_LAYER_NORM_COPY_RATIO, True),
    ]
    return [{"target": name, "measured": value, "goal": goal,
             "verdict": bu.verdict(value, goal, higher_is_better=higher)} for name, value, goal, higher in checks]


def table(rows: list[dict]) -> str:
    display = []
    for r in rows:
        ms = r["ms"]["median"] if r.get("ms") else None
        spread = (f"{r['ms']['p20']:.3g}-{r['ms']['p80']:.3g}" if r.get("ms") else None)
        verdicts = [v for v in (r.get("verdict"), r.get("memory_verdict")) if v]
        display.append({**r, "median_ms": ms, "p20_p80": spread, "check": "/".join(verdicts) or None,
                        "rate": (f"{r['tflops']:.1f} TFLOP/s" if "tflops" in r else
                                 f"{r['gb_s']:.0f} GB/s" if "gb_s" in r else None),
                        "memory": (f"{r['peak_extra_mib']:.0f} MiB" if r.get("peak_extra_mib") is not None else None),
                        "ratio": next((f"{k}={r[k]:.2f}" for k in ("speedup", "copy_ratio") if k in r), None),
                        "mem_ratio": next((f"{k}={r[k]:.2f}" for k in ("memory_ratio", "logits_ratio") if k in r),
                                          None),
                        "status_note": r["status"] if r["status"] == "ok" else f"error: {r.get('error', '')[:70]}"})
    return bu.format_table(display, [("op", "op"), ("case", "case"), ("system", "system"), ("median_ms", "ms"),
                                     ("p20_p80", "p20-p80 ms"), ("rate", "rate"), ("memory", "peak extra"),
                                     ("ratio", "speed"), ("mem_ratio", "memory"), ("check", "target"),
                                     ("status_note", "status")])


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["status"] == "ok"]
    figure, axes = plt.subplots(1, 4, figsize=(22, 5))

    attention = [r for r in rows if r["op"] == "attention" and r["system"] == "fastformer" and "speedup" in r]
    axes[0].barh([r["case"] for r in attention], [r["speedup"] for r in attention],
                 color=["tab:red" if r["padded"] and "verdict" in r else "tab:orange" for r in attention])
    axes[0].axvline(TARGET_ATTENTION_SPEEDUP, color="black", linestyle="--", linewidth=1)
    axes[0].axvline(1.0, color="gray", linewidth=1)
    axes[0].set_title("attention: speedup over SDPA (dashed: target)\n"
                      "red: padded fwd+bwd vs SDPA + mask (the 2x target); orange: the other cases")
    axes[0].tick_params(axis="y", labelsize=6)

    ce = [r for r in rows if r["op"] == "cross_entropy" and r["case"].endswith("fwd+bwd")]
    labels = [f"{r['system']}\n{r['case'].split(' fwd')[0]}" for r in ce]
    axes[1].bar(labels, [r["ms"]["median"] for r in ce], color=colors(ce))
    axes[1].set_ylabel("ms (fwd+bwd)")
    axes[1].set_title("label-smoothed CE: time")
    axes[1].tick_params(axis="x", labelsize=6, labelrotation=20)

    memory = [r for r in rows if r["op"] in ("cross_entropy", "linear_cross_entropy")
              and r.get("peak_extra_mib") is not None]
    axes[2].bar([f"{r['op']}\n{r['system']}\n{r['case'].split(' fwd')[0]}" for r in memory],
                [r["peak_extra_mib"] for r in memory], color=colors(memory))
    if not memory:
        axes[2].text(0.5, 0.5, "peak memory is measured on CUDA only", ha="center", va="center",
                     transform=axes[2].transAxes)
    axes[2].set_ylabel("peak MiB above inputs")
    axes[2].set_title("CE and linear + CE: peak memory")
    axes[2].tick_params(axis="x", labelsize=5, labelrotation=30)

    norm = [r for r in rows if r["op"] in ("residual_layer_norm", "copy")]
    axes[3].bar([f"{r['system']}\n{r['case']}" for r in norm], [r["gb_s"] for r in norm], color=colors(norm))
    axes[3].set_ylabel("GB/s")
    axes[3].set_title("residual LayerNorm vs device copy")
    axes[3].tick_params(axis="x", labelsize=5, labelrotation=30)

    environment = results["environment"]
    figure.suptitle(f"fastformer kernels: {environment['device']}, {results['settings']['dtype']}, "
                    f"torch {environment['torch']}, triton {environment['triton']}, {environment['date'][:10]}",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def colors(rows: list[dict]) -> list[str]:
    return ["tab:red" if r["system"] == "fastformer" else "tab:blue" if r["op"] == "copy" else "tab:gray"
            for r in rows]


SECTIONS = {"attention": attention_rows, "cross_entropy": cross_entropy_rows,
            "linear_cross_entropy": linear_cross_entropy_rows, "residual_layer_norm": layer_norm_rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="default bfloat16 on CUDA; float32 on CPU (the interpreter's bf16 is wrong)")
    parser.add_argument("--ops", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    parser.add_argument("--out-dir", type=Path, help="default runs/benchmarks/<date>-<device>/, or -b, -c, ... after "
                        "it where an earlier run has it")
    args = parser.parse_args(argv)
    if args.out_dir:
        bu.check_output(parser, "--out-dir", args.out_dir, folder=True)
    device = torch.device(args.device)
    if device.type == "cpu":
        # Triton runs on CPU tensors only in its interpreter, chosen when the kernels are defined (imported).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = set(ops) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown ops {sorted(unknown)}; choose from {list(SECTIONS)}")
    if not ops:
        parser.error(f"--ops names no op; choose from {list(SECTIONS)}")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    out_dir = args.out_dir or bu.default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(device, args.quick)
    results = {"benchmark": "kernels", "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
               "environment": bu.environment(device),
               "settings": {"device": args.device, "dtype": str(dtype).removeprefix("torch."), "ops": ops,
                            "quick": args.quick, "label_smoothing": LABEL_SMOOTHING,
                            "layer_norm_dropout": LAYER_NORM_DROPOUT},
               "method": __doc__[__doc__.index("The fused ops"):].strip(), "rows": [], "targets": []}
    print(f"kernels on {results['environment']['device']} ({results['settings']['dtype']}, torch {torch.__version__}, "
          f"commit {results['environment']['commit']}) -> {out_dir}", flush=True)
    interrupted = False
    for op in ops:
        started = time.monotonic()
        try:
            results["rows"] += SECTIONS[op](bench, dtype)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory building inputs: reported, the rest still runs
            results["rows"].append(failed(op, "(whole section)", "-", f"{type(error).__name__}: {error}"))
        except KeyboardInterrupt:
            # A time limit's SIGINT: report what was measured.
            interrupted = results["interrupted"] = True
            print(f"\ninterrupted in {op}: reporting what was measured", flush=True)
            break
        finally:
            bu.free_memory(device)
            results["targets"] = targets(results["rows"])
            bu.write_json(out_dir / "kernels.json", results)
        print(f"  {op}: {time.monotonic() - started:.1f} s", flush=True)
    print()
    print(table(results["rows"]))
    print()
    print("Targets (on an H100, bf16)")
    print(bu.format_table(results["targets"], [("target", "target"), ("measured", "measured"), ("goal", "goal"),
                                               ("verdict", "verdict")]))
    plot(results, out_dir / "kernels.png")
    print(f"\nwrote {out_dir / 'kernels.json'} and {out_dir / 'kernels.png'}")
    return 1 if interrupted or any(r["status"] == "error" for r in results["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
