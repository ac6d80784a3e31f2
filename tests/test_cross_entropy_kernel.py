"""Fused label-smoothed cross-entropy and linear + cross-entropy: the kernels against the reference and PyTorch's own
F.cross_entropy / F.linear.

The kernel tests run on the GPU when there is one, else in Triton's interpreter on the CPU (fp32 and fp16 only: its
bf16 arithmetic is wrong), with blocks made small so that every row spans several of them; the bf16, realistic-shape
and memory checks are the `gpu` tests at the bottom.
"""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import fastformer
import triton_kernels.cross_entropy as kernel_module
from fastformer import reference
from fastformer.nn import LabelSmoothedCrossEntropyLoss, LinearCrossEntropyLoss
from tolerances import FP32, assert_close_lowp
from triton_kernels.cross_entropy import cross_entropy, linear_cross_entropy, unsupported_reason

# Without CUDA, conftest.py has switched Triton to its interpreter, which runs kernels on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 fp32 / 32 fp16 logits, so that the small vocabularies here span several, the last one partial."""
    if DEVICE == "cpu":
        monkeypatch.setattr(kernel_module, "MAX_BLOCK_BYTES", 64)


def random_targets(n_rows: int, vocab: int, ignored: str, generator: torch.Generator,
                   device: str = DEVICE) -> torch.Tensor:
    """-> [n_rows] int64 class ids; `ignored` says which are IGNORE: "none", "some" (every third), "all_but_one" or
    "all"."""
    target = torch.randint(0, vocab, (n_rows,), generator=generator, device=device)
    if ignored == "some":
        target[::3] = IGNORE
    elif ignored == "all_but_one":
        target[torch.arange(n_rows, device=device) != n_rows // 2] = IGNORE
    elif ignored == "all":
        target[:] = IGNORE
    return target


def upstream_gradient(reduction: str, n_rows: int, generator: torch.Generator, device: str = DEVICE,
                      kind: str = "random") -> torch.Tensor:
    """A gradient for the loss, per row for "none": "random" (in [0.5, 1.5), never 1, so that backward's scaling is
    checked), "ones" (loss.backward(): for "none" every other row, the rest random) or "powers_of_two" (a
    GradScaler's: 0.5, 1 or 2)."""
    shape = (n_rows,) if reduction == "none" else ()
    random = 0.5 + torch.rand(shape, generator=generator, device=device)
    if kind == "ones":
        return torch.ones(shape, device=device) if reduction != "none" else torch.where(
            torch.arange(n_rows, device=device) % 2 == 0, 1.0, random)
    if kind == "powers_of_two":
        return 2.0 ** torch.randint(-1, 2, shape, generator=generator, device=device).float()
    return random


def loss_and_grads(fn: Callable, inputs: dict[str, torch.Tensor | None], grad_loss: torch.Tensor,
                   **kwargs) -> dict[str, torch.Tensor]:
    """fn(**fresh leaves of inputs, **kwargs) -> {"loss", "d" + name for every input} (inputs that are None or not
    floating point are passed as they are)."""
    leaves = {name: t.detach().clone().requires_grad_() if t is not None and t.is_floating_point() else t
              for name, t in inputs.items()}
    loss = fn(**leaves, **kwargs)
    differentiable = {name: t for name, t in leaves.items() if t is not None and t.requires_grad}
    grads = torch.autograd.grad(loss, list(differentiable.values()), grad_loss.to(loss.dtype))
    return {"loss": loss.detach(), **{"d" + name: grad for name, grad in zip(differentiable, grads)}}


def assert_all_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        assert actual[name].dtype == expected[name].dtype, name
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m: f"{name}: {m}", **tolerance)


def assert_all_close_lowp(fused: dict[str, torch.Tensor], lowp_torch: dict[str, torch.Tensor],
                          exact: dict[str, torch.Tensor]) -> None:
    """The 2x rule for each result; a "mean" or "sum" loss must be fp32 (F.cross_entropy's is fp16/bf16)."""
    for name in fused:
        reduced_loss = name == "loss" and fused[name].dim() == 0
        assert fused[name].dtype == (torch.float32 if reduced_loss else lowp_torch[name].dtype), name
        assert_close_lowp(fused[name], lowp_torch[name], exact[name], name)


def torch_cross_entropy(logits: torch.Tensor, target: torch.Tensor, **kwargs) -> torch.Tensor:
    return F.cross_entropy(logits, target, ignore_index=IGNORE, **kwargs)


def torch_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight, bias), target, ignore_index=IGNORE, **kwargs)


# ---- cross_entropy -----------------------------------------------------------------------------------------------

def ce_problem(n_rows: int, vocab: int, ignored: str, device: str = DEVICE,
               seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Generator]:
    generator = torch.Generator(device=device).manual_seed(seed)
    # A spread of several units, so that the softmax is far from uniform.
    logits = 3.0 * torch.randn(n_rows, vocab, generator=generator, device=device)
    return {"logits": logits, "target": random_targets(n_rows, vocab, ignored, generator, device)}, generator


def cross_entropy_over_a_temporary(logits: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
    """cross_entropy with overwrite_logits=True on a temporary (logits * 1, whose backward passes the gradient on
    unchanged), as the model's output projection would give it."""
    return cross_entropy(logits * 1.0, target, overwrite_logits=True, **options)


def check_cross_entropy(n_rows: int, vocab: int, dtype: torch.dtype, reduction: str, label_smoothing: float,
                        ignored: str, device: str = DEVICE, overwrite_logits: bool = False,
                        grad_loss_kind: str = "random") -> None:
    """Loss and gradient of the kernel against the reference and F.cross_entropy: tight in fp32; in fp16/bf16 the
    2x rule, against the reference in fp64 on the same rounded logits, with F.cross_entropy in the low precision as
    the baseline."""
    problem, generator = ce_problem(n_rows, vocab, ignored, device)
    grad_loss = upstream_gradient(reduction, n_rows, generator, device, grad_loss_kind)
    options = dict(label_smoothing=label_smoothing, reduction=reduction)
    lowp = {**problem, "logits": problem["logits"].to(dtype)}
    fused = loss_and_grads(cross_entropy_over_a_temporary if overwrite_logits else cross_entropy, lowp, grad_loss,
                           ignore_index=IGNORE, **options)
    # PyTorch's mean over no targets is NaN where ours is 0; compare that case with the reference alone.
    compare_torch = not ((ignored == "all" or n_rows == 0) and reduction == "mean")
    if dtype == torch.float32:
        assert_all_close(fused, loss_and_grads(reference.cross_entropy, problem, grad_loss, ignore_index=IGNORE,
                                               **options), **FP32)
        if compare_torch:
            assert_all_close(fused, loss_and_grads(torch_cross_entropy, problem, grad_loss, **options), **FP32)
        return
    exact = loss_and_grads(reference.cross_entropy, {**lowp, "logits": lowp["logits"].double()}, grad_loss,
                           ignore_index=IGNORE, **options)
    lowp_torch = (loss_and_grads(torch_cross_entropy, lowp, grad_loss, **options) if compare_torch
                  else loss_and_grads(reference.cross_entropy, lowp, grad_loss, ignore_index=IGNORE, **options))
    assert_all_close_lowp(fused, lowp_torch, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignored", ["none", "some"])
def test_cross_entropy_matches_reference_and_torch(small_blocks, dtype, reduction, label_smoothing, ignored):
    check_cross_entropy(13, 100, dtype, reduction, label_smoothing, ignored)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_all_targets_ignored_is_zero_with_zero_gradient(small_blocks, reduction):
    problem, generator = ce_problem(5, 40, "all")
    result = loss_and_grads(cross_entropy, problem, upstream_gradient(reduction, 5, generator), ignore_index=IGNORE,
                            label_smoothing=0.1, reduction=reduction)
    assert torch.equal(result["loss"], torch.zeros_like(result["loss"]))
    assert torch.equal(result["dlogits"], torch.zeros_like(result["dlogits"]))
    check_cross_entropy(5, 40, torch.float32, reduction, 0.1, "all")


@pytest.mark.parametrize("fn", [cross_entropy, reference.cross_entropy], ids=["kernel", "reference"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_with_masked_classes_is_torchs(small_blocks, fn, label_smoothing):
    """Logits of -inf (classes masked out, none a target): without smoothing a finite loss and gradient, as
    F.cross_entropy gives; with it, inf (the mean over classes takes in the masked ones), as F.cross_entropy gives."""
    problem, generator = ce_problem(6, 40, "none")
    masked = torch.arange(40, device=DEVICE) % 7 == 3
    problem["target"] = torch.where(masked[problem["target"]], problem["target"] + 1, problem["target"])
    problem["logits"][:, masked] = float("-inf")
    grad_loss = upstream_gradient("none", 6, generator)
    options = dict(label_smoothing=label_smoothing, reduction="none")
    ours = loss_and_grads(fn, problem, grad_loss, ignore_index=IGNORE, **options)
    theirs = loss_and_grads(torch_cross_entropy, problem, grad_loss, **options)
    assert_all_close(ours, theirs, **FP32)
    assert bool(ours["loss"].isfinite().all()) == (label_smoothing == 0)


@pytest.mark.parametrize("vocab", [1, 16, 17])
@pytest.mark.parametrize("overwrite_logits", [False, True])
def test_cross_entropy_vocab_edges(small_blocks, vocab, overwrite_logits):
    """One class, exactly one block, one block and one element."""
    check_cross_entropy(6, vocab, torch.float32, "mean", 0.1, "some", overwrite_logits=overwrite_logits)


@pytest.mark.parametrize("overwrite_logits", [False, True])
def test_cross_entropy_one_row_and_no_rows(small_blocks, overwrite_logits):
    check_cross_entropy(1, 50, torch.float32, "sum", 0.1, "none", overwrite_logits=overwrite_logits)
    check_cross_entropy(1, 50, torch.float16, "mean", 0.1, "none", overwrite_logits=overwrite_logits,
                        grad_loss_kind="ones")
    check_cross_entropy(0, 50, torch.float32, "mean", 0.1, "none", overwrite_logits=overwrite_logits)


def test_cross_entropy_strided_logits_int32_targets_and_class_zero_ignored(small_blocks):
    """Rows further apart than V (a slice of a wider buffer), int32 class ids, and an ignore_index that is itself a
    class id (as the model's padding id 0 is)."""
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    wide = 3.0 * torch.randn(9, 70, generator=generator, device=DEVICE)
    target = torch.randint(0, 50, (9,), generator=generator, device=DEVICE, dtype=torch.int32)
    target[[1, 4]] = 0
    grad_loss = torch.tensor(1.3, device=DEVICE)
    options = dict(ignore_index=0, label_smoothing=0.1)
    fused = loss_and_grads(lambda wide, target, **kw: cross_entropy(wide[:, :50], target, **kw),
                           {"wide": wide, "target": target}, grad_loss, **options)
    expected = loss_and_grads(lambda wide, target, **kw: F.cross_entropy(wide[:, :50], target.long(), **kw),
                              {"wide": wide, "target": target}, grad_loss, **options)
    assert_all_close(fused, expected, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignored", ["none", "all_but_one"])
@pytest.mark.parametrize("grad_loss_kind", ["ones", "powers_of_two", "random"])
@pytest.mark.parametrize("overwrite_logits", [False, True])
def test_cross_entropy_gradient_from_forward_matches_reference(small_blocks, dtype, reduction, label_smoothing,
                                                               ignored, grad_loss_kind, overwrite_logits):
    """The gradient made in forward and scaled in backward, in its own buffer or over the logits, for upstream
    gradients of 1 (backward touches nothing), powers of two and any value. The one exception to the 2x rule: over
    the logits in fp16/bf16, an arbitrary scale rounds the gradient a second time (checked exactly below); "ones"
    for "none" has such rows too (every other one)."""
    arbitrary_scales = grad_loss_kind == "random" or (grad_loss_kind == "ones" and reduction == "none")
    if overwrite_logits and dtype != torch.float32 and arbitrary_scales:
        pytest.skip("test_cross_entropy_overwrite_logits_scales_the_rounded_gradient covers this case")
    check_cross_entropy(13, 37, dtype, reduction, label_smoothing, ignored, overwrite_logits=overwrite_logits,
                        grad_loss_kind=grad_loss_kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_overwrite_logits_scales_the_rounded_gradient(small_blocks, dtype, reduction):
    """The logits are an intermediate (as a projection's output is); with overwrite_logits=True the gradient that
    reaches them is their own buffer, holding exactly forward's rounded gradient (the separate buffer's for an
    upstream gradient of 1) times the upstream gradient, rounded."""
    problem, generator = ce_problem(11, 45, "some")
    grad_loss = upstream_gradient(reduction, 11, generator)
    reached = {}
    for overwrite, upstream in ((False, torch.ones_like(grad_loss)), (True, grad_loss)):
        source = problem["logits"].to(dtype).requires_grad_()
        logits = source * 2.0
        reached_logits = []
        logits.register_hook(reached_logits.append)
        loss = cross_entropy(logits, problem["target"], ignore_index=IGNORE, label_smoothing=0.1,
                             reduction=reduction, overwrite_logits=overwrite)
        loss.backward(upstream.to(loss.dtype))
        assert (reached_logits[0].data_ptr() == logits.data_ptr()) == overwrite
        reached[overwrite] = reached_logits[0]
    row_scale = grad_loss[:, None] if reduction == "none" else grad_loss
    expected = (reached[False].float() * row_scale.to(loss.dtype).float()).to(dtype)
    torch.testing.assert_close(reached[True], expected, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("overwrite_logits", [False, True])
def test_cross_entropy_forward_is_one_launch_and_backward_one(small_blocks, monkeypatch, reduction,
                                                              overwrite_logits):
    """The loss and its gradient come from one kernel launch in forward; backward is one more (scaling)."""
    launches = count_kernel_launches(monkeypatch)
    problem, generator = ce_problem(9, 40, "some")
    source = problem["logits"].requires_grad_()
    logits = source * 1.0
    loss = cross_entropy(logits, problem["target"], ignore_index=IGNORE, label_smoothing=0.1, reduction=reduction,
                         overwrite_logits=overwrite_logits)
    assert sum(launches.values()) == 1 and launches["_cross_entropy_kernel"] == 1
    loss.backward(upstream_gradient(reduction, 9, generator))
    assert sum(launches.values()) == 2


def count_kernel_launches(monkeypatch) -> dict[str, int]:
    """Counts the launches of every Triton kernel of the module, by name."""
    launches = {name: 0 for name in ("_cross_entropy_kernel", "_scale_rows_kernel")}

    class Counted:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches[self.name] += 1
            return self.kernel[grid]

    for name in launches:
        monkeypatch.setattr(kernel_module, name, Counted(name, getattr(kernel_module, name)))
    return launches


@pytest.mark.parametrize("overwrite_logits", [False, True])
def test_cross_entropy_second_backward_and_double_backward_raise(small_blocks, overwrite_logits):
    """Backward consumes the gradient forward made: a second backward through the graph, or a double backward,
    raises a clear error instead of scaling it twice."""
    problem, _ = ce_problem(6, 20, "some")
    source = problem["logits"].requires_grad_()
    options = dict(ignore_index=IGNORE, label_smoothing=0.1, overwrite_logits=overwrite_logits)
    loss = cross_entropy(source * 1.0, problem["target"], **options)
    loss.backward(torch.tensor(0.5), retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same graph"):
        loss.backward(torch.tensor(0.5))
    loss = cross_entropy(source * 1.0, problem["target"], **options)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, source, create_graph=True)


def test_cross_entropy_overwrite_logits_refuses_a_leaf():
    problem, _ = ce_problem(4, 10, "none")
    with pytest.raises(ValueError, match="overwrite_logits=True needs logits computed"):
        cross_entropy(problem["logits"].requires_grad_(), problem["target"], overwrite_logits=True)


def test_cross_entropy_no_gradient_needed():
    problem, _ = ce_problem(7, 30, "some")
    with torch.no_grad():
        loss = cross_entropy(problem["logits"], problem["target"], ignore_index=IGNORE, label_smoothing=0.1)
    torch.testing.assert_close(loss, torch_cross_entropy(**problem, label_smoothing=0.1), **FP32)


# ---- linear_cross_entropy ----------------------------------------------------------------------------------------

def linear_problem(n_rows: int, d: int, vocab: int, with_bias: bool, ignored: str, device: str = DEVICE,
                   seed: int = 0) -> tuple[dict[str, torch.Tensor | None], torch.Generator]:
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n_rows, d, generator=generator, device=device)
    # Scaled so that the logits spread over a few units, as a trained model's do.
    weight = 2.0 * torch.randn(vocab, d, generator=generator, device=device) / d ** 0.5
    bias = torch.randn(vocab, generator=generator, device=device) if with_bias else None
    target = random_targets(n_rows, vocab, ignored, generator, device)
    return {"hidden": hidden, "weight": weight, "target": target, "bias": bias}, generator


def cast_floats(problem: dict[str, torch.Tensor | None], dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    return {name: t.to(dtype) if t is not None and t.is_floating_point() else t for name, t in problem.items()}


def check_linear_cross_entropy(n_rows: int, d: int, vocab: int, dtype: torch.dtype, with_bias: bool,
                               reduction: str, label_smoothing: float, ignored: str, device: str = DEVICE) -> None:
    """Loss and gradients of hidden, weight, bias against the reference: tight in fp32; in fp16/bf16 the 2x rule,
    against the reference in fp64, with F.linear + F.cross_entropy in the low precision as the baseline."""
    problem, generator = linear_problem(n_rows, d, vocab, with_bias, ignored, device)
    grad_loss = upstream_gradient(reduction, n_rows, generator, device)
    options = dict(ignore_index=IGNORE, label_smoothing=label_smoothing, reduction=reduction)
    lowp = cast_floats(problem, dtype)
    fused = loss_and_grads(linear_cross_entropy, lowp, grad_loss, **options)
    if dtype == torch.float32:
        assert_all_close(fused, loss_and_grads(reference.linear_cross_entropy, problem, grad_loss, **options),
                         **FP32)
        return
    exact = loss_and_grads(reference.linear_cross_entropy, cast_floats(lowp, torch.float64), grad_loss, **options)
    torch_options = dict(label_smoothing=label_smoothing, reduction=reduction)
    assert_all_close_lowp(fused, loss_and_grads(torch_linear_cross_entropy, lowp, grad_loss, **torch_options), exact)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_linear_cross_entropy_matches_reference(small_blocks, reduction, with_bias, label_smoothing):
    # 37 rows make chunks of 37 // LOGITS_FRACTION = 2 rows: nineteen chunks, the last of one row.
    check_linear_cross_entropy(37, 16, 50, torch.float32, with_bias, reduction, label_smoothing, "some")


@pytest.mark.parametrize("fn", [linear_cross_entropy, reference.linear_cross_entropy], ids=["kernel", "reference"])
def test_linear_cross_entropy_with_masked_classes_is_torchs(small_blocks, fn):
    """A bias of -inf masks classes out (none a target): without smoothing the loss and gradients are
    F.linear + F.cross_entropy's, finite."""
    problem, generator = linear_problem(9, 16, 50, True, "none", DEVICE)
    masked = torch.arange(50, device=DEVICE) % 5 == 2
    problem["target"] = torch.where(masked[problem["target"]], problem["target"] + 1, problem["target"])
    problem["bias"][masked] = float("-inf")
    grad_loss = upstream_gradient("sum", 9, generator)
    ours = loss_and_grads(fn, problem, grad_loss, ignore_index=IGNORE, reduction="sum")
    theirs = loss_and_grads(torch_linear_cross_entropy, problem, grad_loss, reduction="sum")
    assert all(bool(grad.isfinite().all()) for name, grad in ours.items() if name != "dbias")
    assert_all_close(ours, theirs, **FP32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_fp16(small_blocks, reduction):
    check_linear_cross_entropy(20, 32, 70, torch.float16, True, reduction, 0.1, "some")


def test_linear_cross_entropy_matches_torch(small_blocks):
    problem, generator = linear_problem(19, 8, 30, True, "some")
    grad_loss = upstream_gradient("mean", 19, generator)
    assert_all_close(loss_and_grads(linear_cross_entropy, problem, grad_loss, ignore_index=IGNORE, label_smoothing=0.1),
                     loss_and_grads(torch_linear_cross_entropy, problem, grad_loss, label_smoothing=0.1), **FP32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_all_targets_ignored(small_blocks, reduction):
    problem, generator = linear_problem(9, 8, 30, True, "all")
    result = loss_and_grads(linear_cross_entropy, problem, upstream_gradient(reduction, 9, generator),
                            ignore_index=IGNORE, label_smoothing=0.1, reduction=reduction)
    for name, value in result.items():
        assert torch.equal(value, torch.zeros_like(value)), name


def test_linear_cross_entropy_under_autocast_runs_the_matmuls_in_its_dtype():
    """fp32 hidden and weight under autocast: fp16 logits (as F.linear gives), fp32 gradients; the 2x rule with the
    reference under the same autocast as the baseline (F.cross_entropy would run in fp32 there, and return fp32).
    fp16 because the CPU interpreter's bf16 is wrong; bf16 is a GPU test."""
    check_linear_cross_entropy_autocast(24, 32, 70, torch.float16, device=DEVICE)


def check_linear_cross_entropy_autocast(n_rows: int, d: int, vocab: int, dtype: torch.dtype, device: str) -> None:
    problem, generator = linear_problem(n_rows, d, vocab, False, "some", device)
    grad_loss = upstream_gradient("mean", n_rows, generator, device)
    options = dict(ignore_index=IGNORE, label_smoothing=0.1)
    with torch.autocast(device, dtype=dtype):
        fused = loss_and_grads(linear_cross_entropy, problem, grad_loss, **options)
        lowp_reference = loss_and_grads(reference.linear_cross_entropy, problem, grad_loss, **options)
    exact = loss_and_grads(reference.linear_cross_entropy,
                           cast_floats(cast_floats(problem, dtype), torch.float64), grad_loss, **options)
    assert fused["loss"].dtype == torch.float32
    assert fused["dhidden"].dtype == fused["dweight"].dtype == torch.float32
    assert_all_close_lowp(fused, lowp_reference, exact)


def test_linear_cross_entropy_no_gradient_needed():
    problem, _ = linear_problem(10, 8, 30, True, "some")
    with torch.no_grad():
        loss = linear_cross_entropy(**problem, ignore_index=IGNORE)
    torch.testing.assert_close(loss, torch_linear_cross_entropy(**problem), **FP32)


@pytest.mark.parametrize("n_rows", [1, 7, 100, 1000, 25_000, 200_000])
@pytest.mark.parametrize("vocab, element_size", [(37_000, 2), (37_000, 4), (50, 4)])
def test_linear_cross_entropy_chunks_are_a_small_part_of_the_logits(n_rows, vocab, element_size):
    rows = kernel_module._chunk_rows(n_rows, vocab, element_size)
    assert 1 <= rows <= max(1, n_rows // 16)
    assert rows * vocab * element_size <= kernel_module.CHUNK_LOGITS_BYTES
    if rows >= kernel_module.GEMM_ROW_TILE:
        assert rows % kernel_module.GEMM_ROW_TILE == 0


def transient_peak_bytes(step: Callable[[], None]) -> int:
    """The most bytes the CPU allocator held at once during step() beyond what it held before, from the profiler's
    record of every allocation and free (torch has no peak-memory counter on the CPU)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events = sorted((e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


@pytest.mark.skipif(DEVICE != "cpu", reason="measures the CPU allocator; the GPU test below measures CUDA's")
def test_linear_cross_entropy_transient_memory_below_a_quarter_of_the_logits():
    """Forward and backward, gradients included, hold at most a quarter of what the fp32 N x V logits alone take;
    unfused F.linear + F.cross_entropy, measured the same way, holds more than all of them (so the measurement
    sees the logits)."""
    problem, _ = linear_problem(512, 16, 1000, False, "some")
    logits_bytes = 512 * 1000 * 4

    def step(fn: Callable) -> Callable[[], None]:
        hidden = problem["hidden"].clone().requires_grad_()
        weight = problem["weight"].clone().requires_grad_()
        return lambda: fn(hidden, weight, problem["target"], label_smoothing=0.1).backward()

    fused = transient_peak_bytes(step(lambda *args, **kw: linear_cross_entropy(*args, ignore_index=IGNORE, **kw)))
    unfused = transient_peak_bytes(step(torch_linear_cross_entropy))
    assert unfused > logits_bytes
    assert 0 < fused <= logits_bytes / 4, f"{fused} bytes vs logits {logits_bytes}"


def test_linear_cross_entropy_second_backward_and_double_backward_raise(small_blocks):
    problem, _ = linear_problem(8, 8, 30, True, "some")
    leaves = {name: t.requires_grad_() if name != "target" else t for name, t in problem.items()}
    loss = linear_cross_entropy(**leaves, ignore_index=IGNORE)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same graph"):
        loss.backward()
    loss = linear_cross_entropy(**leaves, ignore_index=IGNORE)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, leaves["hidden"], create_graph=True)


# ---- through the nn modules and the backend switch ---------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_label_smoothed_cross_entropy_module_under_triton_backend(small_blocks, reduction, kernel_calls):
    generator = torch.Generator(device=DEVICE).manual_seed(5)
    inputs = {"logits": 3.0 * torch.randn(2, 6, 40, generator=generator, device=DEVICE),
              "target": torch.randint(1, 40, (2, 6), generator=generator, device=DEVICE)}
    inputs["target"][1, 3:] = 0
    grad_loss = 0.5 + torch.rand((2, 6) if reduction == "none" else (), generator=generator, device=DEVICE)
    criterion = LabelSmoothedCrossEntropyLoss(ignore_index=0, label_smoothing=0.1, reduction=reduction)
    results = {}
    for name in ("triton", "reference"):
        with fastformer.backend(name):
            results[name] = loss_and_grads(criterion, inputs, grad_loss)
    assert results["triton"]["loss"].shape == ((2, 6) if reduction == "none" else ())
    assert kernel_calls == {"cross_entropy": 1}
    assert_all_close(results["triton"], results["reference"], **FP32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_module_under_triton_backend(small_blocks, reduction, kernel_calls):
    generator = torch.Generator(device=DEVICE).manual_seed(6)
    inputs = {"hidden": torch.randn(3, 5, 16, generator=generator, device=DEVICE),
              "weight": torch.randn(40, 16, generator=generator, device=DEVICE) / 4,
              "target": torch.randint(1, 40, (3, 5), generator=generator, device=DEVICE)}
    inputs["target"][2, 1:] = 0
    grad_loss = 0.5 + torch.rand((3, 5) if reduction == "none" else (), generator=generator, device=DEVICE)
    criterion = LinearCrossEntropyLoss(ignore_index=0, label_smoothing=0.1, reduction=reduction)
    results = {}
    for name in ("triton", "reference"):
        with fastformer.backend(name):
            results[name] = loss_and_grads(criterion, inputs, grad_loss)
    assert kernel_calls == {"linear_cross_entropy": 1}
    assert_all_close(results["triton"], results["reference"], **FP32)


# ---- torch.compile -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overwrite_logits", [False, True])
def test_cross_entropy_under_torch_compile(small_blocks, overwrite_logits):
    """(Under torch.compile the gradient always gets its own buffer: overwrite_logits changes nothing there.)"""
    def loss_fn(logits, target):
        # An intermediate, so that overwriting it is allowed.
        return cross_entropy(logits * 2.0, target, ignore_index=IGNORE, label_smoothing=0.1,
                             overwrite_logits=overwrite_logits)

    problem, generator = ce_problem(9, 40, "some")
    grad_loss = upstream_gradient("mean", 9, generator)
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    # Eager over the logits scales the rounded gradient (a last-bit difference in fp32).
    tolerance = FP32 if overwrite_logits else dict(atol=0.0, rtol=0.0)
    assert_all_close(loss_and_grads(compiled, problem, grad_loss), loss_and_grads(loss_fn, problem, grad_loss),
                     **tolerance)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_under_torch_compile(small_blocks, reduction):
    def loss_fn(hidden, weight, target, bias):
        return linear_cross_entropy(hidden, weight, target, bias, ignore_index=IGNORE, label_smoothing=0.1,
                                    reduction=reduction)

    problem, generator = linear_problem(12, 8, 30, True, "some")
    grad_loss = upstream_gradient(reduction, 12, generator)
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    assert_all_close(loss_and_grads(compiled, problem, grad_loss), loss_and_grads(loss_fn, problem, grad_loss),
                     atol=0.0, rtol=0.0)


@pytest.mark.interpreter
def test_custom_op_registration(small_blocks):
    """PyTorch's own checks of the schemas, the fake (meta) functions and the autograd registrations.

    With inputs that need gradients, opcheck's AOT test makes the op's every output a graph output, including the
    gradient made in forward, which backward then updates in place: AOT Autograd refuses an output that is mutated
    later. The public functions never return it, and the torch.compile tests below run them forward and backward;
    here the AOT test runs on inputs without gradients."""
    with_grad = ("test_schema", "test_autograd_registration", "test_faketensor")
    problem, _ = ce_problem(6, 20, "some")
    logits = problem["logits"].requires_grad_()
    for reduction, check_targets in (("mean", True), ("none", False), ("sum", True)):
        args = (problem["target"], IGNORE, 0.1, reduction)
        torch.library.opcheck(torch.ops.fastformer.cross_entropy.default, (logits, *args, True, check_targets),
                              test_utils=with_grad)
        torch.library.opcheck(torch.ops.fastformer.cross_entropy.default,
                              (logits.detach(), *args, True, check_targets))
        torch.library.opcheck(torch.ops.fastformer.cross_entropy_over_logits.default,
                              (logits.detach().clone(), *args, check_targets))
    torch.library.opcheck(torch.ops.fastformer.cross_entropy.default,
                          (logits.detach(), problem["target"], IGNORE, 0.1, "mean", False, True))
    torch.library.opcheck(torch.ops.fastformer.scale_gradient_.default,
                          (logits.detach().clone(), torch.rand(6), problem["target"], IGNORE))
    linear, _ = linear_problem(6, 8, 20, True, "some")
    leaves = [t.requires_grad_() for t in (linear["hidden"], linear["weight"], linear["bias"])]
    for reduction, compute_grads, check_targets in (("mean", True, False), ("none", False, True)):
        args = (linear["target"], IGNORE, 0.1, reduction, torch.float32, compute_grads, check_targets)
        torch.library.opcheck(torch.ops.fastformer.linear_cross_entropy.default,
                              (leaves[0], leaves[1], args[0], leaves[2], *args[1:]), test_utils=with_grad)
        torch.library.opcheck(torch.ops.fastformer.linear_cross_entropy.default,
                              (leaves[0].detach(), leaves[1].detach(), args[0], leaves[2].detach(), *args[1:]))


def test_unchecked_targets_skip_the_host_check(small_blocks, monkeypatch):
    """check_targets=False never runs the (syncing) class-id check, and leaves the loss and gradients unchanged."""
    problem, generator = linear_problem(12, 8, 30, True, "some")
    grad_loss = upstream_gradient("mean", 12, generator)

    def loss_fn(check_targets):
        def loss(hidden, weight, bias, target):
            return linear_cross_entropy(hidden, weight, target, bias, ignore_index=IGNORE, label_smoothing=0.1,
                                        check_targets=check_targets)
        return loss

    checked = loss_and_grads(loss_fn(True), problem, grad_loss)
    logits = problem["hidden"] @ problem["weight"].T

    def no_check(*args):
        raise AssertionError("the class ids were checked")

    monkeypatch.setattr("triton_kernels.cross_entropy._check_class_ids", no_check)
    assert_all_close(loss_and_grads(loss_fn(False), problem, grad_loss), checked, atol=0.0, rtol=0.0)
    torch.testing.assert_close(cross_entropy(logits, problem["target"], IGNORE, check_targets=False),
                               F.cross_entropy(logits, problem["target"], ignore_index=IGNORE), **FP32)
    with pytest.raises(AssertionError, match="were checked"):
        cross_entropy(logits, problem["target"], IGNORE)


# ---- bad input ---------------------------------------------------------------------------------------------------

def test_cross_entropy_rejects_bad_input():
    logits, target = torch.randn(4, 10, device=DEVICE), torch.tensor([1, 2, IGNORE, 9], device=DEVICE)
    with pytest.raises(ValueError, match="target holds class ids outside"):
        cross_entropy(logits, torch.tensor([1, 2, 10, 3], device=DEVICE))
    with pytest.raises(ValueError, match="target holds class ids outside"):
        cross_entropy(logits, torch.tensor([1, -1, 0, 3], device=DEVICE))
    with pytest.raises(ValueError, match="target must have shape"):
        cross_entropy(logits, target[:3])
    with pytest.raises(TypeError, match="target must hold int64 or int32"):
        cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match="logits must be"):
        cross_entropy(logits[None], target)
    with pytest.raises(ValueError, match="logits must be"):
        cross_entropy(logits[:, :0], target)
    with pytest.raises(ValueError, match="logits has dtype torch.float64"):
        cross_entropy(logits.double(), target)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        cross_entropy(logits.tolist(), target)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(TypeError, match="ignore_index"):
        cross_entropy(logits, target, ignore_index=0.5)
    with pytest.raises(ValueError, match="target is on meta"):
        cross_entropy(logits, target.to("meta"))


def test_linear_cross_entropy_rejects_bad_input():
    hidden, weight = torch.randn(4, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE)
    target = torch.tensor([1, 2, IGNORE, 9], device=DEVICE)
    with pytest.raises(ValueError, match="target holds class ids outside"):
        linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 10, 3], device=DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(hidden, weight[:, :4], target)
    with pytest.raises(ValueError, match="hidden must be"):
        linear_cross_entropy(hidden[None], weight, target)
    with pytest.raises(ValueError, match="bias must have shape"):
        linear_cross_entropy(hidden, weight, target, bias=torch.zeros(9, device=DEVICE))
    with pytest.raises(ValueError, match="target must have shape"):
        linear_cross_entropy(hidden, weight, target[:2])
    with pytest.raises(TypeError, match="weight has dtype torch.float16 but hidden"):
        linear_cross_entropy(hidden, weight.half(), target)
    with pytest.raises(ValueError, match="bias is on meta"):
        linear_cross_entropy(hidden, weight, target, bias=torch.zeros(10, device="meta"))
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, target, reduction="avg")


def test_unsupported_reason():
    assert unsupported_reason(torch.randn(2, 3)) is None
    assert unsupported_reason(torch.randn(2, 3).half()) is None
    assert "float64" in unsupported_reason(torch.randn(2, 3).double())


# ---- fp32 sums: the reduced loss, the matmuls into fp32 gradients ------------------------------------------------

@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_reduced_fp16_loss_is_the_fp32_sum(op, reduction):
    """A "sum" or "mean" over 300 rows of fp16 logits is fp32 and equals F.cross_entropy's in fp32 on the same
    rounded logits: rounded to fp16, a sum of ~1.5e3 (fp16's spacing there: 1) or a mean of ~5 would be off by up to
    3e-4 of itself."""
    if op == "cross_entropy":
        problem, _ = ce_problem(300, 40, "some")
        logits = problem["logits"].half()
        loss = cross_entropy(logits, problem["target"], ignore_index=IGNORE, label_smoothing=0.1,
                             reduction=reduction)
    else:
        problem, _ = linear_problem(300, 16, 40, False, "some")
        hidden, weight = problem["hidden"].half(), problem["weight"].half()
        loss = linear_cross_entropy(hidden, weight, problem["target"], ignore_index=IGNORE, label_smoothing=0.1,
                                    reduction=reduction)
        logits = F.linear(hidden, weight)
    expected = torch_cross_entropy(logits.float(), problem["target"], label_smoothing=0.1, reduction=reduction)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, **FP32)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reference_reduced_bf16_loss_is_the_fp32_sum(reduction):
    """The reference, the other backend of the same ops, reduces bf16 logits in fp32 too."""
    problem, _ = ce_problem(300, 40, "some")
    logits = problem["logits"].bfloat16()
    loss = reference.cross_entropy(logits, problem["target"], ignore_index=IGNORE, reduction=reduction)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch_cross_entropy(logits.float(), problem["target"], reduction=reduction),
                               **FP32)


def mm_into_problem(accumulate: bool, device: str) -> tuple[torch.Tensor, ...]:
    """-> (out, a, b, expected): fp32 out (random for accumulate, NaN else), bf16 a: [64, 48], b: [48, 40], and the
    fp64 out (+)= a @ b."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(64, 48, generator=generator, device=device).bfloat16()
    b = torch.randn(48, 40, generator=generator, device=device).bfloat16()
    start = torch.randn(64, 40, generator=generator, device=device)
    out = start.clone() if accumulate else torch.full_like(start, float("nan"))
    expected = a.double() @ b.double() + (start.double() if accumulate else 0.0)
    return out, a, b, expected


def assert_mm_into_error_within(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, expected: torch.Tensor,
                                relative: float) -> None:
    """|out - expected| <= relative * (|a| @ |b|) + 1e-6 elementwise."""
    bound = relative * (a.double().abs() @ b.double().abs()) + 1e-6
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), f"error {error.max():.3e}, bound {bound.min():.3e}"


@pytest.mark.parametrize("accumulate", [False, True])
def test_mm_into_fallback_adds_the_bf16_product_in_fp32(monkeypatch, accumulate):
    """The path of the CPU and of a torch whose matmul cannot write bf16 factors' product into fp32: the product is
    rounded once to bf16 (half a bf16 ulp: 2**-9 of it), then summed in fp32; against the fp64 product."""
    monkeypatch.setattr(kernel_module, "_fp32_out_matmul", lambda device, dtype: False)
    out, a, b, expected = mm_into_problem(accumulate, DEVICE)
    kernel_module._mm_into(out, a, b, accumulate)
    assert_mm_into_error_within(out, a, b, expected, 2.0 ** -8)


def test_fp32_out_matmul_decision():
    """On meta tensors (shape and dtype checks only) a torch from 2.13 on takes the probe's calls as written (2.11
    refuses the fp32 `self` of addmm: the fallback); the CPU, which has no kernels for them, is decided for the
    fallback."""
    probe = kernel_module._fp32_out_matmul.__wrapped__
    takes_fp32_self = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)
    for dtype in (torch.bfloat16, torch.float16):
        assert probe(torch.device("meta"), dtype) == takes_fp32_self
        assert not probe(torch.device("cpu"), dtype)


# ---- GPU: bf16/fp16 at realistic shapes, memory --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab", [37_000, 32_768, 50_257])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.gpu
def test_gpu_cross_entropy_matches_reference(dtype, vocab, reduction):
    check_cross_entropy(4096, vocab, dtype, reduction, 0.1, "some", device="cuda")


@pytest.mark.parametrize("d", [512, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
def test_gpu_linear_cross_entropy_under_autocast(d, dtype):
    check_linear_cross_entropy_autocast(4096, d, 37_000, dtype, device="cuda")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.gpu
def test_gpu_linear_cross_entropy_bf16_parameters(reduction):
    check_linear_cross_entropy(4096, 512, 37_000, torch.bfloat16, True, reduction, 0.1, "some", device="cuda")


@pytest.mark.gpu
def test_gpu_linear_cross_entropy_peak_memory_below_a_quarter_of_the_logits():
    """Forward and backward under bf16 autocast with fp32 parameters (as the trainer runs): the memory beyond the
    inputs and their gradients stays below a quarter of what the bf16 N x V logits alone would take."""
    n_rows, d, vocab = 32768, 512, 37_000
    problem, _ = linear_problem(n_rows, d, vocab, False, "some", device="cuda")
    hidden, weight = problem["hidden"].requires_grad_(), problem["weight"].requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, problem["target"], ignore_index=IGNORE, label_smoothing=0.1)
    loss.backward()
    torch.cuda.synchronize()
    gradients = hidden.grad.nbytes + weight.grad.nbytes
    extra = torch.cuda.max_memory_allocated() - baseline - gradients
    logits_bytes = n_rows * vocab * torch.finfo(torch.bfloat16).bits // 8
    assert extra < logits_bytes / 4, f"extra {extra / 2**20:.0f} MiB vs logits {logits_bytes / 2**20:.0f} MiB"


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.gpu
def test_gpu_mm_into_both_paths(monkeypatch, accumulate):
    """The fp32-out cuBLAS path (where this torch has it) rounds the product once, to fp32; the fallback (forced)
    rounds it to bf16 first. Each within its bound of the fp64 product."""
    supported = kernel_module._fp32_out_matmul(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    for forced, relative in ((True, 48 * 2.0 ** -23), (False, 2.0 ** -8)):
        if forced and not supported:
            continue
        monkeypatch.setattr(kernel_module, "_fp32_out_matmul", lambda device, dtype, forced=forced: forced)
        out, a, b, expected = mm_into_problem(accumulate, "cuda")
        kernel_module._mm_into(out, a, b, accumulate)
        assert_mm_into_error_within(out, a, b, expected, relative)
