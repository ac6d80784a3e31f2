"""Fused FlashAttention-style kernel: forward and dq/dk/dv against the reference and torch's
scaled_dot_product_attention, on the masks the Transformer needs and strided (fused-QKV) inputs, on both of its
paths: the short-sequence one (one forward and one backward kernel per (batch, head)) and the long (flash) one,
forced by lowering the short path's bound to 0.

The kernel tests run on the GPU when there is one, else in Triton's interpreter on the CPU (fp32 and fp16 only: its
bf16 arithmetic is wrong); the bf16 and realistic-shape checks are the `gpu` tests at the bottom.
"""

import collections
import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastformer
from fastformer import dispatch
from fastformer.nn import MultiheadAttention
from fastformer.reference.attention import attention as reference_attention
from tolerances import FP32, assert_close_lowp
import triton_kernels.attention as attention_kernels
from triton_kernels.attention import SHORT_PATH_MAX_LEN, attention_dropout_mask, flash_attention, unsupported_reason

# Without CUDA, conftest.py has switched Triton to its interpreter, which runs kernels on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Case(NamedTuple):
    batch: int
    q_len: int
    k_len: int
    heads: int
    head_dim: int
    q_lengths: list[int] | None
    k_lengths: list[int] | None
    causal: bool


# Small shapes that cross the interpreter's 16-wide blocks at odd places.
CASES = {
    "full": Case(2, 20, 20, 2, 32, None, None, False),
    "padded, lengths 1 and not block multiples": Case(3, 37, 37, 2, 32, [37, 17, 1], [37, 17, 1], False),
    "causal with padding": Case(3, 37, 37, 2, 32, [37, 17, 1], [37, 17, 1], True),
    "causal, no padding": Case(2, 33, 33, 1, 64, None, None, True),
    "cross, q_len < k_len": Case(2, 19, 45, 2, 32, [19, 4], [45, 7], False),
    "causal cross, q_len > k_len": Case(2, 40, 23, 1, 32, [40, 30], [23, 5], True),
    "one key": Case(2, 18, 1, 2, 32, None, None, False),
    "all but one key padded": Case(2, 17, 33, 2, 64, None, [1, 33], False),
    "one query": Case(2, 1, 30, 2, 32, [1, 1], [30, 3], False),
    "all padding but one query and one key": Case(3, 21, 21, 2, 32, [1, 21, 1], [1, 1, 21], True),
}

PATH_KERNELS = {
    "short": {"_short_attention_fwd_kernel", "_short_attention_bwd_kernel"},
    "long": {"_flash_attention_fwd_kernel", "_flash_attention_bwd_preprocess_kernel",
             "_flash_attention_bwd_dkdv_kernel", "_flash_attention_bwd_dq_kernel"},
}


@pytest.fixture
def kernel_launches(monkeypatch) -> collections.Counter:
    """Counts the launches of each Triton kernel by name (on the GPU, autotuning adds its benchmark runs)."""
    launches: collections.Counter = collections.Counter()
    kernel_class = type(attention_kernels._short_attention_fwd_kernel)
    run = kernel_class.run

    def counted_run(kernel, *args, **kwargs):
        launches[kernel.fn.__name__] += 1
        return run(kernel, *args, **kwargs)

    monkeypatch.setattr(kernel_class, "run", counted_run)
    return launches


@pytest.fixture(params=["short", "long"])
def path(request, monkeypatch) -> str:
    """Which attention path the test runs: "long" lowers the short path's bound to 0, so every length takes it;
    "short" turns the short path on for compiled (GPU) launches too."""
    if request.param == "long":
        monkeypatch.setattr(attention_kernels, "SHORT_PATH_MAX_LEN", 0)
    else:
        monkeypatch.setattr(attention_kernels, "SHORT_PATH_ON_GPU", True)
    return request.param


def assert_path_ran(launches: collections.Counter, path: str) -> None:
    """The attention kernels launched are all, and only, those of `path` (the dropout-mask kernel aside)."""
    ran = set(launches) - {"_dropout_mask_kernel"}
    assert ran == PATH_KERNELS[path], ran


def lengths_tensor(lengths: list[int] | None, device: str) -> torch.Tensor | None:
    return None if lengths is None else torch.tensor(lengths, device=device)


def random_problem(case: Case, device: str = DEVICE, seed: int = 0) -> dict[str, torch.Tensor]:
    """-> q, dout: [batch, q_len, heads, head_dim], k, v: [batch, k_len, heads, head_dim], fp32."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(length: int) -> torch.Tensor:
        return torch.randn(case.batch, length, case.heads, case.head_dim, generator=generator, device=device)

    # q scaled up so that the softmax is far from uniform.
    return {"q": 2.0 * randn(case.q_len), "k": randn(case.k_len), "v": randn(case.k_len), "dout": randn(case.q_len)}


def fused_projection_views(q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The strided views a fused projection produces, as nn.MultiheadAttention makes them: q/k/v of one
    [batch, len, 3, heads, head_dim] buffer for self-attention, else k/v of one [batch, k_len, 2, ...] buffer and q
    in a heads-major buffer."""
    if q.shape == k.shape:
        views = torch.stack([q, k, v], dim=2).unbind(dim=2)
    else:
        views = (q.transpose(1, 2).contiguous().transpose(1, 2), *torch.stack([k, v], dim=2).unbind(dim=2))
    assert not any(view.is_contiguous() for view in views)
    return views


def outputs_and_grads(fn: Callable, problem: dict[str, torch.Tensor], dtype: torch.dtype, case: Case,
                      strided: bool = False, **kwargs) -> dict[str, torch.Tensor]:
    """Runs fn(q, k, v, q_lengths=, k_lengths=, causal=) on fresh leaves of `dtype` and backpropagates dout
    -> {"out", "dq", "dk", "dv"}."""
    leaves = [problem[name].to(dtype).detach().requires_grad_() for name in ("q", "k", "v")]
    q, k, v = fused_projection_views(*leaves) if strided else leaves
    device = problem["q"].device.type
    out = fn(q, k, v, q_lengths=lengths_tensor(case.q_lengths, device),
             k_lengths=lengths_tensor(case.k_lengths, device), causal=case.causal, **kwargs)
    grads = torch.autograd.grad(out, leaves, problem["dout"].to(dtype))
    return {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def visible_keys(q_len: int, k_len: int, k_lengths: torch.Tensor | None, causal: bool, batch: int,
                 device: str) -> torch.Tensor:
    """-> [batch, 1, q_len, k_len] bool, True where a query sees a key (scaled_dot_product_attention's convention)."""
    keys = torch.arange(k_len, device=device)
    visible = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool, device=device)
    if k_lengths is not None:
        visible = visible & (keys[None, :] < k_lengths[:, None])[:, None, None, :]
    if causal:
        visible = visible & (keys[None, :] <= torch.arange(q_len, device=device)[:, None])
    return visible


def zero_padded_queries(out: torch.Tensor, q_lengths: torch.Tensor | None) -> torch.Tensor:
    """out: [batch, q_len, ...] -> out with the rows at or past q_lengths zeroed (no gradient flows to them)."""
    if q_lengths is None:
        return out
    padded = torch.arange(out.shape[1], device=out.device)[None, :] >= q_lengths[:, None]
    return out.masked_fill(padded.view(*padded.shape, *(1,) * (out.dim() - 2)), 0.0)


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: torch.Tensor | None,
               k_lengths: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """torch's own attention with the equivalent boolean mask (no row is fully masked: key 0 is always visible).
    Its math backend, so that fp32 stays fp32 on the GPU too."""
    mask = visible_keys(q.shape[1], k.shape[1], k_lengths, causal, q.shape[0], q.device.type)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return zero_padded_queries(out.transpose(1, 2), q_lengths)


def lowp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: torch.Tensor | None,
                   k_lengths: torch.Tensor | None, causal: bool, dropout_p: float = 0.0,
                   dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch attention computed in the inputs' own (low) precision: the baseline of the 2x rule.
    dropout_mask: [batch, heads, q_len, k_len] bool (True = keep) applied to the probabilities."""
    mask = visible_keys(q.shape[1], k.shape[1], k_lengths, causal, q.shape[0], q.device.type)
    scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / math.sqrt(q.shape[-1])
    probabilities = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    if dropout_mask is not None:
        probabilities = probabilities * dropout_mask / (1.0 - dropout_p)
    return zero_padded_queries((probabilities @ v.transpose(1, 2)).transpose(1, 2), q_lengths)


def assert_all_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        assert actual[name].dtype == expected[name].dtype, name
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m: f"{name}: {m}", **tolerance)


def check_kernel(case: Case, dtype: torch.dtype, strided: bool = False, device: str = DEVICE,
                 kernel: Callable = flash_attention) -> None:
    """The kernel's output and gradients: against the reference and torch's SDPA in fp32, the 2x rule in fp16/bf16."""
    problem = random_problem(case, device)
    fused = outputs_and_grads(kernel, problem, dtype, case, strided)
    if dtype == torch.float32:
        assert_all_close(fused, outputs_and_grads(reference_attention, problem, dtype, case), **FP32)
        assert_all_close(fused, outputs_and_grads(torch_sdpa, problem, dtype, case), **FP32)
        return
    # Inputs rounded to the low precision first, so that the reference does not charge their rounding to anyone.
    rounded = {name: t.to(dtype) for name, t in problem.items()}
    exact = outputs_and_grads(reference_attention, rounded, torch.float64, case)
    lowp_torch = outputs_and_grads(lowp_attention, problem, dtype, case)
    for name in fused:
        assert fused[name].dtype == dtype, name
        if exact[name].any():
            assert_close_lowp(fused[name], lowp_torch[name], exact[name], name)
        else:
            # dq and dk over a single visible key are zero in exact arithmetic (a softmax over one key is constant),
            # and plain PyTorch hits that zero exactly. The kernel, like FlashAttention, takes delta = rowsum(dout *
            # out) from the rounded out, which leaves a residue of out's rounding: allow one unit of roundoff of the
            # gradients' scale.
            bound = torch.finfo(dtype).eps * exact["dv"].abs().max().item()
            assert fused[name].abs().max().item() <= bound, name


# ---- the kernel against the reference and torch ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference_and_torch(name, dtype, path, kernel_launches):
    check_kernel(CASES[name], dtype)
    assert_path_ran(kernel_launches, path)


@pytest.mark.parametrize("name", ["full", "causal with padding", "cross, q_len < k_len"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_reads_fused_projection_views(name, dtype, path, kernel_launches):
    check_kernel(CASES[name], dtype, strided=True)
    assert_path_ran(kernel_launches, path)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_kernel_head_dims(head_dim, path, kernel_launches):
    check_kernel(Case(2, 21, 21, 2, head_dim, [21, 6], [21, 6], True), torch.float32, strided=True)
    assert_path_ran(kernel_launches, path)


# Lengths at the edges of the interpreter's 16-row steps and of the short path's power-of-2 key tile, and one past
# the short path's bound (which takes the long path whatever the test asks). head_dim 32 keeps 128 keys of fp32
# within the short path's tile budget.
@pytest.mark.parametrize("length", [1, 7, 16, 17, 100, SHORT_PATH_MAX_LEN, SHORT_PATH_MAX_LEN + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_tile_edges(length, dtype, path, kernel_launches):
    shorter = max(1, length // 3)
    check_kernel(Case(2, length, length, 1, 32, [length, shorter], [shorter, length], True), dtype, strided=True)
    assert_path_ran(kernel_launches, "long" if length > SHORT_PATH_MAX_LEN else path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_cross_attention_past_the_short_bound(dtype, kernel_launches):
    """Queries within the short path's bound but keys past it: the long path."""
    check_kernel(Case(2, 9, SHORT_PATH_MAX_LEN + 1, 1, 32, [9, 3], [SHORT_PATH_MAX_LEN + 1, 40], False), dtype)
    assert_path_ran(kernel_launches, "long")


@pytest.mark.parametrize("causal", [False, True])
def test_short_path_is_one_forward_and_one_backward_kernel(causal, kernel_calls, kernel_launches, monkeypatch):
    monkeypatch.setattr(attention_kernels, "SHORT_PATH_ON_GPU", True)  # compiled launches take it only when asked
    def counted_kernel(*args, **kwargs):
        return attention_kernels.flash_attention(*args, **kwargs)  # looked up at call time, where kernel_calls counts

    check_kernel(CASES["causal with padding"]._replace(causal=causal), torch.float32, strided=True,
                 kernel=counted_kernel)
    assert kernel_calls == {"flash_attention": 1}
    assert kernel_launches == {"_short_attention_fwd_kernel": 1, "_short_attention_bwd_kernel": 1}


def test_padded_positions_are_never_read_and_padded_gradients_are_zero(path):
    """Garbage (NaN) at padded positions of q, k, v and in the gradient of padded query rows cannot reach any result:
    padded rows come out exactly zero, and so do the gradients of padded queries and keys."""
    case = CASES["causal with padding"]
    problem = random_problem(case)
    q_lengths, k_lengths = (lengths_tensor(lengths, DEVICE) for lengths in (case.q_lengths, case.k_lengths))
    padded_q = (torch.arange(case.q_len, device=DEVICE)[None, :] >= q_lengths[:, None])[:, :, None, None]
    padded_k = (torch.arange(case.k_len, device=DEVICE)[None, :] >= k_lengths[:, None])[:, :, None, None]
    garbage = {"q": problem["q"].masked_fill(padded_q, float("nan")),
               "k": problem["k"].masked_fill(padded_k, float("nan")),
               "v": problem["v"].masked_fill(padded_k, float("nan")),
               "dout": problem["dout"].masked_fill(padded_q, float("nan"))}
    fused = outputs_and_grads(flash_attention, garbage, torch.float32, case)
    clean = {name: t.masked_fill(padded_q if name in ("q", "dout") else padded_k, 0.0) for name, t in garbage.items()}
    assert_all_close(fused, outputs_and_grads(reference_attention, clean, torch.float32, case), **FP32)
    for name, padded in (("out", padded_q), ("dq", padded_q), ("dk", padded_k), ("dv", padded_k)):
        assert torch.all(fused[name].masked_select(padded) == 0.0), name


def test_empty_batch_and_no_queries(path):
    for case in (Case(0, 5, 5, 2, 32, None, None, False), Case(2, 0, 5, 2, 32, None, None, True)):
        problem = random_problem(case)
        assert_all_close(outputs_and_grads(flash_attention, problem, torch.float32, case),
                         outputs_and_grads(reference_attention, problem, torch.float32, case), atol=0.0, rtol=0.0)


# ---- bad input -------------------------------------------------------------------------------------------------

def test_kernel_rejects_bad_input():
    q = torch.randn(2, 5, 2, 32, device=DEVICE)
    k = torch.randn(2, 7, 2, 32, device=DEVICE)
    lengths = torch.tensor([5, 3], device=DEVICE)
    with pytest.raises(ValueError, match="q must be 4-D"):
        flash_attention(q[0], k, k)
    with pytest.raises(ValueError, match="v"):
        flash_attention(q, k, k[:, :6])
    with pytest.raises(ValueError, match="batch, heads and head_dim"):
        flash_attention(q, k[:, :, :1], k[:, :, :1])
    with pytest.raises(ValueError, match="no key"):
        flash_attention(q, k[:, :0], k[:, :0])
    with pytest.raises(ValueError, match="float64"):
        flash_attention(q.double(), k.double(), k.double())
    with pytest.raises(ValueError, match="k has dtype"):
        flash_attention(q, k.half(), k)
    with pytest.raises(ValueError, match="head_dim is 16"):
        flash_attention(q[..., :16], k[..., :16], k[..., :16])
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        flash_attention(q, k, k.tolist())
    with pytest.raises(TypeError, match="q_lengths"):
        flash_attention(q, k, k, q_lengths=lengths.float())
    with pytest.raises(TypeError, match="k_lengths"):
        flash_attention(q, k, k, k_lengths=[7, 7])
    with pytest.raises(ValueError, match="k_lengths must have shape"):
        flash_attention(q, k, k, k_lengths=lengths[:1])
    with pytest.raises(ValueError, match=r"q_lengths must lie in \[0, 5\]"):
        flash_attention(q, k, k, q_lengths=torch.tensor([6, 3], device=DEVICE))
    with pytest.raises(ValueError, match="q_lengths must lie"):
        flash_attention(q, k, k, q_lengths=torch.tensor([-1, 3], device=DEVICE))
    with pytest.raises(ValueError, match=r"k_lengths must lie in \[1, 7\]"):
        flash_attention(q, k, k, k_lengths=torch.tensor([8, 3], device=DEVICE))
    with pytest.raises(ValueError, match="k_lengths has a 0"):
        flash_attention(q, k, k, k_lengths=torch.tensor([0, 3], device=DEVICE))
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attention(q, k, k, dropout_p=1.0)


def test_unchecked_lengths_skip_the_host_check_and_are_clamped(monkeypatch, path):
    """check_lengths=False never runs the (syncing) value check; lengths outside [0, len] act as clamped to it."""
    case = CASES["causal cross, q_len > k_len"]
    problem = random_problem(case)
    clamped = outputs_and_grads(flash_attention, problem, torch.float32,
                                case._replace(q_lengths=[40, 0], k_lengths=[23, 5]))

    def no_check(*args):
        raise AssertionError("the length values were checked")

    monkeypatch.setattr("triton_kernels.attention.check_length_values", no_check)
    unchecked = outputs_and_grads(flash_attention, problem, torch.float32,
                                  case._replace(q_lengths=[41, -3], k_lengths=[99, 5]), check_lengths=False)
    assert_all_close(unchecked, clamped, atol=0.0, rtol=0.0)
    with pytest.raises(AssertionError, match="were checked"):
        outputs_and_grads(flash_attention, problem, torch.float32, case)


def test_unsupported_reason():
    q = torch.randn(1, 3, 2, 64)
    assert unsupported_reason(q, q, q) is None
    assert unsupported_reason(q.half(), q.half(), q.half()) is None
    assert "float64" in unsupported_reason(q.double(), q.double(), q.double())
    assert "head_dim is 48" in unsupported_reason(q[..., :48], q[..., :48], q[..., :48])


# ---- dropout ---------------------------------------------------------------------------------------------------

def test_dropout_same_seed_same_result():
    case = CASES["causal with padding"]
    problem = random_problem(case)
    first = outputs_and_grads(flash_attention, problem, torch.float32, case, dropout_p=0.3, seed=7)
    again = outputs_and_grads(flash_attention, problem, torch.float32, case, dropout_p=0.3, seed=7)
    other = outputs_and_grads(flash_attention, problem, torch.float32, case, dropout_p=0.3, seed=8)
    assert_all_close(first, again, atol=0.0, rtol=0.0)
    assert not torch.equal(first["out"], other["out"])
    # seed=None draws from torch's default generator, so torch.manual_seed makes it reproducible.
    torch.manual_seed(3)
    drawn = outputs_and_grads(flash_attention, problem, torch.float32, case, dropout_p=0.3)
    torch.manual_seed(3)
    assert_all_close(drawn, outputs_and_grads(flash_attention, problem, torch.float32, case, dropout_p=0.3),
                     atol=0.0, rtol=0.0)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_dropout_keep_rate(dropout_p):
    keep = attention_dropout_mask(11, 2, 4, 64, 96, dropout_p, device=DEVICE)
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / keep.numel())
    assert abs(keep.float().mean().item() - (1 - dropout_p)) < 5 * sigma
    # Neighbouring rows and heads must not repeat one another's draws.
    assert not torch.equal(keep[:, :, 0], keep[:, :, 1]) and not torch.equal(keep[:, 0], keep[:, 1])


def check_dropout_consistency(case: Case, dtype: torch.dtype, device: str = DEVICE) -> None:
    """Forward and gradients of the kernel with dropout equal the reference given the kernel's own mask."""
    dropout_p, seed = 0.2, 1234
    keep = attention_dropout_mask(seed, case.batch, case.heads, case.q_len, case.k_len, dropout_p, device=device)
    problem = random_problem(case, device)
    fused = outputs_and_grads(flash_attention, problem, dtype, case, dropout_p=dropout_p, seed=seed)
    if dtype == torch.float32:
        expected = outputs_and_grads(reference_attention, problem, dtype, case, dropout_p=dropout_p, dropout_mask=keep)
        assert_all_close(fused, expected, **FP32)
        return
    rounded = {name: t.to(dtype) for name, t in problem.items()}
    masked = dict(dropout_p=dropout_p, dropout_mask=keep)
    exact = outputs_and_grads(reference_attention, rounded, torch.float64, case, **masked)
    lowp_torch = outputs_and_grads(lowp_attention, problem, dtype, case, **masked)
    for name in fused:
        assert_close_lowp(fused[name], lowp_torch[name], exact[name], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["causal with padding", "cross, q_len < k_len"])
def test_dropout_forward_and_backward_match_reference_with_its_mask(name, dtype, path, kernel_launches):
    check_dropout_consistency(CASES[name], dtype)
    assert_path_ran(kernel_launches, path)


def test_dropout_mask_is_the_same_on_both_paths(monkeypatch):
    """The Philox offsets are positions in [batch, heads, q_len, k_len], not tiles: both paths drop the same
    probabilities, so with one seed they agree to rounding."""
    case = CASES["causal with padding"]
    problem = random_problem(case)
    short = outputs_and_grads(flash_attention, problem, torch.float32, case, dropout_p=0.3, seed=9)
    monkeypatch.setattr(attention_kernels, "SHORT_PATH_MAX_LEN", 0)
    long = outputs_and_grads(flash_attention, problem, torch.float32, case, dropout_p=0.3, seed=9)
    assert_all_close(short, long, **FP32)


# ---- torch.compile, custom op, dispatch ------------------------------------------------------------------------

def test_torch_compile_matches_eager():
    case = CASES["causal with padding"]

    def layer(q, k, v, q_lengths, k_lengths, causal):
        return flash_attention(q, k, v, q_lengths, k_lengths, causal, dropout_p=0.1, seed=5)

    def packed_layer(q, k, v, q_lengths, k_lengths, causal):
        return flash_attention(torch.stack([q, k, v], dim=2), None, None, q_lengths, k_lengths, causal,
                               dropout_p=0.1, seed=5)

    problem = random_problem(case)
    expected = outputs_and_grads(layer, problem, torch.float32, case, strided=True)
    for fn in (layer, packed_layer):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        assert_all_close(outputs_and_grads(compiled, problem, torch.float32, case, strided=True), expected,
                         atol=0.0, rtol=0.0)


def test_custom_op_registration():
    """PyTorch's own checks of the schema, the fake (meta) function and the autograd registration."""
    case = CASES["cross, q_len < k_len"]
    problem = random_problem(case)
    q, k, v = (problem[name].requires_grad_() for name in ("q", "k", "v"))
    q_lengths, k_lengths = (lengths_tensor(lengths, DEVICE) for lengths in (case.q_lengths, case.k_lengths))
    seed = torch.tensor([5], device=DEVICE)
    kv = torch.stack([k, v], dim=2).detach().requires_grad_()
    qkv = torch.stack([q[:, :19], k[:, :19], v[:, :19]], dim=2).detach().requires_grad_()
    for check_lengths in (True, False):
        torch.library.opcheck(torch.ops.fastformer.flash_attention.default,
                              (q, k, v, q_lengths, k_lengths, True, 0.1, seed, check_lengths))
    # The packed op shares the length check with the one above: once each.
    torch.library.opcheck(torch.ops.fastformer.flash_attention_packed.default,
                          (q, kv, q_lengths, k_lengths, True, 0.1, seed, False))
    torch.library.opcheck(torch.ops.fastformer.flash_attention_packed.default,
                          (None, qkv, q_lengths, q_lengths, True, 0.1, seed, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["qkv", "kv"])
def test_packed_forms_match_the_reference(form, dtype, path, kernel_launches):
    """flash_attention(qkv) and flash_attention(q, kv): the output, and the packed input's gradient (one buffer of
    its shape), equal the reference on the separate q, k, v (2x rule in fp16)."""
    case = CASES["causal with padding" if form == "qkv" else "cross, q_len < k_len"]
    problem = random_problem(case)
    q_lengths, k_lengths = (lengths_tensor(lengths, DEVICE) for lengths in (case.q_lengths, case.k_lengths))
    masks = dict(q_lengths=q_lengths, k_lengths=k_lengths, causal=case.causal)

    def run(fn, run_dtype: torch.dtype, packed_call: bool) -> list[torch.Tensor]:
        q, k, v = (problem[name].to(dtype).to(run_dtype) for name in ("q", "k", "v"))
        if form == "qkv":
            leaves = [torch.stack([q, k, v], dim=2).requires_grad_()]
            inputs = (leaves[0], None, None) if packed_call else leaves[0].unbind(2)
        else:
            leaves = [q.requires_grad_(), torch.stack([k, v], dim=2).requires_grad_()]
            inputs = (q, leaves[1], None) if packed_call else (q, *leaves[1].unbind(2))
        out = fn(*inputs, **masks)
        return [out.detach(), *torch.autograd.grad(out, leaves, problem["dout"].to(dtype).to(run_dtype))]

    fused = run(flash_attention, dtype, packed_call=True)
    assert_path_ran(kernel_launches, path)
    if dtype == torch.float32:
        for actual, expected in zip(fused, run(reference_attention, dtype, packed_call=False)):
            torch.testing.assert_close(actual, expected, **FP32)
        return
    exact = run(reference_attention, torch.float64, packed_call=True)  # the reference's own packed form
    lowp_torch = run(lowp_attention, dtype, packed_call=False)
    for name, actual, lowp, expected in zip(["out", "d(q)kv", "dkv"], fused, lowp_torch, exact):
        assert actual.dtype == dtype and actual.shape == expected.shape, name
        assert_close_lowp(actual, lowp, expected, name)


def test_packed_forms_reject_bad_shapes():
    q = torch.randn(2, 5, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"packed qkv .* must be \[batch, len, 3"):
        flash_attention(q)
    with pytest.raises(ValueError, match=r"packed kv .* must be \[batch, k_len, 2"):
        flash_attention(q, torch.randn(2, 7, 3, 2, 32, device=DEVICE))
    with pytest.raises(ValueError, match="v given without k"):
        flash_attention(q, None, q)


def autograd_node_names(tensor: torch.Tensor) -> set[str]:
    """The names of every node in tensor's backward graph."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("inputs", ["self", "key is value", "separate"])
def test_multihead_attention_module_runs_the_kernel_through_dispatch(inputs, path, kernel_calls, kernel_launches):
    """nn.MultiheadAttention under the "triton" backend (the fused projection's packed output into the kernel)
    equals the reference; the packed q/k/v reach the kernel whole, so no unbind/stack copies their gradient."""
    torch.manual_seed(0)
    module = MultiheadAttention(64, 2, batch_first=True).to(DEVICE)
    x = torch.randn(2, 9, 64, device=DEVICE)
    memory = x if inputs == "self" else torch.randn(2, 11, 64, device=DEVICE)
    value = torch.randn(2, 11, 64, device=DEVICE) if inputs == "separate" else memory
    query_lengths = torch.tensor([9, 4], device=DEVICE)
    key_lengths = query_lengths if inputs == "self" else torch.tensor([11, 6], device=DEVICE)
    results = {}
    for backend in ("triton", "reference"):
        module.zero_grad()
        with fastformer.backend(backend):
            out = module(x, memory, value, is_causal=inputs == "self", query_lengths=query_lengths,
                         key_lengths=key_lengths)[0]
        if backend == "triton":
            assert not {"UnbindBackward0", "StackBackward0"} & autograd_node_names(out)
        out.backward(torch.cos(out.detach()))
        results[backend] = [out.detach()] + [p.grad.clone() for p in module.parameters()]
    # Once, under "triton": a comparison of the reference with itself would prove nothing.
    assert kernel_calls == {"flash_attention": 1}
    assert_path_ran(kernel_launches, path)
    for fused, expected in zip(results["triton"], results["reference"]):
        torch.testing.assert_close(fused, expected, **FP32)


def test_dispatch_refuses_an_explicit_mask_under_triton(kernel_calls):
    q = torch.randn(1, 4, 2, 32, device=DEVICE)
    mask = torch.tensor([False, True, False, False], device=DEVICE)
    with fastformer.backend("triton"), pytest.raises(dispatch.UnsupportedInputError, match="explicit attn_mask"):
        dispatch.attention(q, q, q, attn_mask=mask)
    assert not kernel_calls


@pytest.mark.skipif(DEVICE == "cuda", reason="a limit of Triton's interpreter")
def test_dispatch_refuses_bfloat16_in_the_interpreter(kernel_calls):
    q = torch.randn(1, 4, 2, 32, dtype=torch.bfloat16)
    with fastformer.backend("triton"), pytest.raises(dispatch.UnsupportedInputError, match="bfloat16 on the CPU"):
        dispatch.attention(q, q, q)
    assert not kernel_calls


def test_dispatch_falls_back_for_an_explicit_mask_under_auto(monkeypatch, kernel_calls):
    monkeypatch.setattr(dispatch, "_auto_runs_triton", lambda tensor: True)
    q = torch.randn(1, 4, 2, 32, device=DEVICE)
    mask = torch.tensor([False, True, False, False], device=DEVICE)
    with fastformer.backend("auto"), pytest.warns(UserWarning, match="attention falls back.*explicit attn_mask"):
        out = dispatch.attention(q, q, q, attn_mask=mask)
    assert not kernel_calls
    torch.testing.assert_close(out, reference_attention(q, q, q, attn_mask=mask), atol=0.0, rtol=0.0)


# ---- GPU: bf16/fp16 at realistic shapes ------------------------------------------------------------------------

def wmt_like_case(heads: int, kind: str, seed: int = 0) -> Case:
    """Batch 32 with random sentence lengths 5..100 (the longest exactly 100): causal or padded self-attention, or
    cross-attention from target to source lengths."""
    generator = torch.Generator().manual_seed(seed)
    src, tgt = (torch.randint(5, 101, (32,), generator=generator) for _ in range(2))
    src[0], tgt[1] = 100, 100
    src, tgt = src.tolist(), tgt.tolist()
    if kind == "cross":
        return Case(32, 100, 100, heads, 64, tgt, src, False)
    return Case(32, 100, 100, heads, 64, tgt, tgt, kind == "causal")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [8, 16])
@pytest.mark.parametrize("kind", ["causal", "padded", "cross"])
@pytest.mark.gpu
def test_gpu_kernel_matches_reference(dtype, heads, kind):
    check_kernel(wmt_like_case(heads, kind), dtype, strided=True, device="cuda")


# Each new (head_dim, causal) autotunes the kernels afresh, so a few pairs rather than all six.
@pytest.mark.parametrize(("head_dim", "causal"), [(32, True), (64, False), (128, True)])
@pytest.mark.gpu
def test_gpu_fp32_is_tight(head_dim, causal):
    case = wmt_like_case(8, "causal" if causal else "padded")._replace(head_dim=head_dim)
    check_kernel(case, torch.float32, strided=True, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
def test_gpu_dropout_consistent_with_forward(dtype):
    check_dropout_consistency(wmt_like_case(8, "causal"), dtype, device="cuda")


@pytest.mark.gpu
def test_gpu_long_sequences_cross_many_blocks():
    check_kernel(Case(2, 700, 1000, 4, 64, [700, 333], [1000, 517], True), torch.bfloat16, device="cuda")
