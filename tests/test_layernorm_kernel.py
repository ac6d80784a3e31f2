"""Fused residual(+dropout)+LayerNorm: the reference against F.layer_norm, the Triton kernel against the reference.

The kernel tests run on the GPU when there is one, else in Triton's interpreter on the CPU (fp32 and fp16 only: its
bf16 arithmetic is wrong); the bf16 and realistic-shape checks are the `gpu` tests at the bottom.
"""

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import TransformerConfig
from fastformer.model import DecoderLayer, EncoderLayer
from fastformer.nn import ResidualLayerNorm
from fastformer.reference.layernorm import residual_layer_norm as reference_layer_norm
from tolerances import FP32, assert_close_lowp
from triton_kernels import layernorm_residual
from triton_kernels.layernorm_residual import residual_layer_norm, unsupported_reason

# Without CUDA, conftest.py has switched Triton to its interpreter, which runs kernels on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                     eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D] -> (F.layer_norm(residual + x), residual + x): plain PyTorch, no dropout."""
    s = x if residual is None else residual + x
    return F.layer_norm(s, (x.shape[-1],), weight, bias, eps), s


def random_problem(shape: tuple[int, ...], with_residual: bool, grad_on: str, device: str = "cpu",
                   seed: int = 0) -> list[torch.Tensor | None]:
    """-> [x, residual, weight, bias, dy, ds] in fp32; residual is None without one, dy/ds None where no gradient
    arrives ("y", "s" or "both")."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device)

    n_cols = shape[-1]
    # An offset and a scale, so that the mean subtraction and the variance matter.
    x = 0.5 + 2.0 * randn(*shape)
    residual = randn(*shape) if with_residual else None
    weight, bias = 1.0 + 0.5 * randn(n_cols), 0.5 * randn(n_cols)
    dy = randn(*shape) if grad_on in ("y", "both") else None
    ds = randn(*shape) if grad_on in ("s", "both") else None
    return [x, residual, weight, bias, dy, ds]


def cast(tensors: list[torch.Tensor | None], dtype: torch.dtype) -> list[torch.Tensor | None]:
    return [None if t is None else t.to(dtype) for t in tensors]


def outputs_and_grads(fn: Callable, problem: list[torch.Tensor | None], **kwargs) -> dict[str, torch.Tensor]:
    """Runs fn(x, residual, weight, bias, **kwargs) -> (y, s) on fresh leaves and backpropagates dy into y and ds
    into s -> {"y", "s", "dx", "dresidual", "dweight", "dbias"} (a gradient that does not flow is zeros)."""
    x, residual, weight, bias, dy, ds = problem
    inputs = {name: t.detach().clone().requires_grad_()
              for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)) if t is not None}
    y, s = fn(inputs["x"], inputs.get("residual"), inputs["weight"], inputs["bias"], **kwargs)
    used = [(output, grad) for output, grad in ((y, dy), (s, ds)) if grad is not None]
    grads = torch.autograd.grad([output for output, _ in used], list(inputs.values()), [grad for _, grad in used],
                                allow_unused=True)
    result = {"y": y.detach(), "s": s.detach()}
    for (name, leaf), grad in zip(inputs.items(), grads):
        result["d" + name] = torch.zeros_like(leaf) if grad is None else grad
    return result


def assert_all_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        assert actual[name].dtype == expected[name].dtype, name
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m: f"{name}: {m}", **tolerance)


def check_kernel(shape: tuple[int, ...], dtype: torch.dtype, with_residual: bool, grad_on: str,
                 device: str = DEVICE) -> None:
    """The kernel's outputs and gradients against the reference: tight in fp32, the 2x rule in fp16/bf16."""
    problem = random_problem(shape, with_residual, grad_on, device)
    fused = outputs_and_grads(residual_layer_norm, cast(problem, dtype))
    if dtype == torch.float32:
        assert_all_close(fused, outputs_and_grads(reference_layer_norm, problem), **FP32)
        return
    # Inputs rounded to the low precision first, so that the reference does not charge their rounding to anyone.
    exact = outputs_and_grads(reference_layer_norm, cast(cast(problem, dtype), torch.float64))
    lowp_torch = outputs_and_grads(torch_layer_norm, cast(problem, dtype))
    for name in fused:
        assert fused[name].dtype == dtype, name
        assert_close_lowp(fused[name], lowp_torch[name], exact[name], name)


# ---- the reference ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
def test_reference_matches_torch_layer_norm(dtype, with_residual):
    problem = cast(random_problem((3, 5, 24), with_residual, "both"), dtype)
    tolerance = FP32 if dtype == torch.float32 else {}
    assert_all_close(outputs_and_grads(reference_layer_norm, problem), outputs_and_grads(torch_layer_norm, problem),
                     **tolerance)


def test_reference_dropout_mask_scales_kept_elements():
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    keep = torch.rand(4, 16) > 0.25
    _, s = reference_layer_norm(x, residual, torch.ones(16), torch.zeros(16), dropout_p=0.25, dropout_mask=keep)
    torch.testing.assert_close(s, residual + torch.where(keep, x / 0.75, 0.0), **FP32)
    with pytest.raises(ValueError, match="dropout_mask"):
        reference_layer_norm(x, residual, torch.ones(16), torch.zeros(16), dropout_p=0.25, dropout_mask=keep.float())


# ---- the kernel against the reference --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_cols", [8, 100, 512, 1000])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("grad_on", ["y", "s", "both"])
def test_kernel_matches_reference(dtype, n_cols, with_residual, grad_on):
    check_kernel((2, 7, n_cols), dtype, with_residual, grad_on)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 100), (100,), (3, 4, 5, 40)])
def test_kernel_single_row_and_other_ranks(dtype, shape):
    check_kernel(shape, dtype, with_residual=True, grad_on="both")


def test_kernel_empty_batch():
    check_kernel((0, 3, 16), torch.float32, with_residual=True, grad_on="both")


def test_kernel_many_rows_split_over_programs():
    """More row tiles than backward programs, and a last program with fewer rows: the two-stage dweight/dbias sum."""
    check_kernel((37, 300), torch.float32, with_residual=True, grad_on="both")


@pytest.mark.parametrize("n_rows, block_rows, program_cap",
                         [(n, b, c) for n in (0, 1, 2, 7, 37, 4096, 32771) for b in (1, 2, 4) for c in (1, 3, 528)])
def test_backward_grid_covers_every_row_once(n_rows, block_rows, program_cap):
    """Contiguous runs of whole tiles, at most program_cap of them, none empty, together exactly the rows."""
    rows_per_program, num_programs = layernorm_residual._backward_grid(n_rows, block_rows, program_cap)
    assert rows_per_program % block_rows == 0 and num_programs <= program_cap
    runs = [range(p * rows_per_program, min((p + 1) * rows_per_program, n_rows)) for p in range(num_programs)]
    assert all(len(run) > 0 for run in runs)
    assert [row for run in runs for row in run] == list(range(n_rows))


def test_resident_programs_per_sm_takes_the_tightest_limit():
    """H100-like limits (65536 registers, 2048 threads, 227 KiB shared memory a multiprocessor), worked by hand."""
    h100 = dict(regs_per_sm=65536, threads_per_sm=2048, shared_per_sm=232448)
    # 150 registers are allocated as 152: 152 * 128 threads = 19456 registers a program, 3 of which fit.
    assert layernorm_residual._resident_programs_per_sm(150, 4096, 4, **h100) == 3
    # 32 registers: the 2048 threads allow 16 programs of 4 warps before registers (16) or shared memory (56) do.
    assert layernorm_residual._resident_programs_per_sm(32, 4096, 4, **h100) == 16
    # Shared memory binds: 100 KiB a program.
    assert layernorm_residual._resident_programs_per_sm(32, 102400, 4, **h100) == 2
    # A program that needs more than a multiprocessor has still gets one.
    assert layernorm_residual._resident_programs_per_sm(255, 0, 16, **h100) == 1


# (shape, backward programs at most): one program for every row, a few uneven runs, more programs than tiles; a
# single row; D not a power of two with 2 rows a tile (1000) and 4 (300); rows narrower than a group of 4 columns.
BACKWARD_SPLITS = [((37, 300), 1), ((37, 300), 3), ((37, 300), 1000), ((1, 300), 1000), ((9, 1000), 2),
                   ((9, 1000), 1000), ((2, 3, 5), 2), ((4, 3), 3)]


@pytest.mark.parametrize("shape, program_cap", BACKWARD_SPLITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("grad_on", ["y", "both"])
def test_backward_split_over_programs_matches_reference(shape, program_cap, dtype, with_residual, grad_on,
                                                        monkeypatch):
    """The backward's rows split into other numbers of programs than the interpreter's default."""
    monkeypatch.setattr(layernorm_residual, "_backward_program_cap", lambda *args, **kwargs: program_cap)
    check_kernel(shape, dtype, with_residual, grad_on)


def test_backward_more_partials_than_the_second_stage_loads_at_once(monkeypatch):
    """10 programs' partial sums, which the second stage adds up 4 at a time (the last block part-empty)."""
    monkeypatch.setattr(layernorm_residual, "_backward_program_cap", lambda *args, **kwargs: 1000)
    monkeypatch.setattr(layernorm_residual, "SUM_BLOCK_PARTIALS", 4)
    check_kernel((37, 300), torch.float32, with_residual=True, grad_on="both")


@pytest.mark.parametrize("shape, program_cap", BACKWARD_SPLITS)
def test_backward_split_over_programs_with_dropout(shape, program_cap, monkeypatch):
    """The mask backward regenerates matches the forward's however the rows are split."""
    monkeypatch.setattr(layernorm_residual, "_backward_program_cap", lambda *args, **kwargs: program_cap)
    check_dropout_consistency(shape, with_residual=True)


@pytest.mark.parametrize("with_residual", [True, False])
def test_kernel_mixed_dtypes_as_under_autocast(with_residual):
    """fp16 x (a sublayer's output), fp32 residual stream and parameters: outputs take the dtype of residual + x."""
    x, residual, weight, bias, dy, ds = random_problem((5, 64), with_residual, "both", DEVICE)
    out_dtype = torch.float32 if with_residual else torch.float16
    mixed = [x.half(), residual, weight, bias, *cast([dy, ds], out_dtype)]
    fused = outputs_and_grads(residual_layer_norm, mixed)
    expected = outputs_and_grads(reference_layer_norm, mixed)
    exact = outputs_and_grads(reference_layer_norm, cast(mixed, torch.float64))
    assert fused["y"].dtype == fused["s"].dtype == out_dtype and fused["dx"].dtype == torch.float16
    for name in fused:
        assert fused[name].dtype == expected[name].dtype, name
        if fused[name].dtype == torch.float32:
            torch.testing.assert_close(fused[name], expected[name], msg=lambda m: f"{name}: {m}", **FP32)
        else:
            assert_close_lowp(fused[name], expected[name], exact[name], name)


def test_kernel_rejects_bad_input():
    x, residual = torch.randn(2, 3, 16, device=DEVICE), torch.randn(2, 3, 16, device=DEVICE)
    weight, bias = torch.ones(16, device=DEVICE), torch.zeros(16, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        residual_layer_norm(x, residual[:, :2], weight, bias)
    with pytest.raises(ValueError, match="weight"):
        residual_layer_norm(x, residual, torch.ones(8), bias)
    with pytest.raises(ValueError, match="bias"):
        residual_layer_norm(x, residual, weight, torch.zeros(2, 8))
    with pytest.raises(TypeError, match="bias"):
        residual_layer_norm(x, residual, weight, bias.half())
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        residual_layer_norm(x.double(), None, weight, bias)
    with pytest.raises(ValueError, match="dropout_p"):
        residual_layer_norm(x, residual, weight, bias, dropout_p=1.0)
    with pytest.raises(ValueError, match="eps"):
        residual_layer_norm(x, residual, weight, bias, eps=0.0)
    with pytest.raises(TypeError, match="weight"):
        residual_layer_norm(x, residual, weight.tolist(), bias)


def test_unsupported_reason():
    x = torch.randn(2, 16)
    assert unsupported_reason(x, x, torch.ones(16), torch.zeros(16)) is None
    assert unsupported_reason(x, None, torch.ones(16), torch.zeros(16)) is None
    assert "float64" in unsupported_reason(x.double(), None, torch.ones(16), torch.zeros(16))
    assert "8192" in unsupported_reason(torch.empty(1, 8193), None, torch.ones(8193), torch.zeros(8193))


# ---- dropout ---------------------------------------------------------------------------------------------------

def recovered_keep_mask(shape: tuple[int, ...], dropout_p: float, seed: int, device: str = DEVICE) -> torch.Tensor:
    """The kernel's keep-mask for this shape and seed: with x = 1 and residual = 0, s = keep / (1 - p)."""
    ones = torch.ones(shape, device=device)
    _, s = residual_layer_norm(ones, torch.zeros_like(ones), torch.ones(shape[-1], device=device),
                               torch.zeros(shape[-1], device=device), dropout_p=dropout_p, seed=seed)
    assert torch.all((s == 0) | torch.isclose(s, torch.tensor(1 / (1 - dropout_p), device=device)))
    return s != 0


def test_dropout_same_seed_same_output():
    x, residual, weight, bias, _, _ = random_problem((6, 100), True, "both", DEVICE)
    first = residual_layer_norm(x, residual, weight, bias, dropout_p=0.3, seed=7)
    again = residual_layer_norm(x, residual, weight, bias, dropout_p=0.3, seed=7)
    other = residual_layer_norm(x, residual, weight, bias, dropout_p=0.3, seed=8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[1], other[1])
    # seed=None draws from torch's default generator, so torch.manual_seed makes it reproducible.
    torch.manual_seed(3)
    drawn = residual_layer_norm(x, residual, weight, bias, dropout_p=0.3)
    torch.manual_seed(3)
    assert torch.equal(drawn[1], residual_layer_norm(x, residual, weight, bias, dropout_p=0.3)[1])


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_dropout_keep_rate(dropout_p):
    keep = recovered_keep_mask((64, 512), dropout_p, seed=11)
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / keep.numel())
    assert abs(keep.float().mean().item() - (1 - dropout_p)) < 5 * sigma


def test_dropout_mask_depends_on_row_and_column_only():
    """A row's mask is the same in a batch of 5 rows as in one of 12 (other tiles, other programs)."""
    assert torch.equal(recovered_keep_mask((5, 300), 0.3, seed=2), recovered_keep_mask((12, 300), 0.3, seed=2)[:5])


def test_dropout_columns_sharing_a_philox_call_are_independent():
    """Four adjacent columns come from one Philox call: each keeps at rate 1 - p, and they agree no more often
    than independent draws would (a lane reused for another would agree every time)."""
    dropout_p = 0.5
    keep = recovered_keep_mask((64, 512), dropout_p, seed=13).reshape(64, 128, 4)
    sigma = math.sqrt(0.25 / (64 * 128))
    for lane in range(4):
        assert abs(keep[..., lane].float().mean().item() - (1 - dropout_p)) < 5 * sigma
        for other in range(lane + 1, 4):
            agreement = (keep[..., lane] == keep[..., other]).float().mean().item()
            assert abs(agreement - 0.5) < 5 * sigma, (lane, other)


def check_dropout_consistency(shape: tuple[int, ...], with_residual: bool, device: str = DEVICE) -> None:
    """Forward and every gradient of the kernel with dropout equal the reference given the kernel's own mask."""
    dropout_p, seed = 0.2, 1234
    keep = recovered_keep_mask(shape, dropout_p, seed, device)
    problem = random_problem(shape, with_residual, "both", device)
    fused = outputs_and_grads(residual_layer_norm, problem, dropout_p=dropout_p, seed=seed)
    expected = outputs_and_grads(reference_layer_norm, problem, dropout_p=dropout_p, dropout_mask=keep)
    assert_all_close(fused, expected, **FP32)


@pytest.mark.parametrize("with_residual", [True, False])
def test_dropout_backward_consistent_with_forward(with_residual):
    check_dropout_consistency((3, 5, 100), with_residual)


# ---- through the nn module and the backend switch -----------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [True, False])
def test_residual_layer_norm_module_under_triton_backend(with_residual, kernel_calls):
    x, residual, weight, bias, dy, ds = random_problem((2, 5, 40), with_residual, "both", DEVICE)
    module = ResidualLayerNorm(40).to(DEVICE)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    results = {}
    for name in ("triton", "reference"):
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, residual)]
        with fastformer.backend(name):
            y, s = module(*leaves, return_sum=True)
        inputs = [t for t in (*leaves, module.weight, module.bias) if t is not None]
        results[name] = [y, s, *torch.autograd.grad([y, s], inputs, [dy, ds])]
    # Once, under "triton": a comparison of the reference with itself would prove nothing.
    assert kernel_calls == {"residual_layer_norm": 1}
    for fused, expected in zip(results["triton"], results["reference"], strict=True):
        torch.testing.assert_close(fused, expected, **FP32)


def autocast_problem(dtype: torch.dtype, with_residual: bool,
                     compute_dtype: torch.dtype) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """-> (what a ResidualLayerNorm(40) with fp32 parameters gets under autocast to compute_dtype: x, residual in
    `dtype`, dy/ds in compute_dtype (autograd's requirement); the same with x, residual rounded to compute_dtype as
    the module casts them, in fp64: the oracle's input)."""
    x, residual, weight, bias, dy, ds = random_problem((2, 5, 40), with_residual, "both")
    given = [*cast([x, residual], dtype), weight, bias, *cast([dy, ds], compute_dtype)]
    rounded = [*cast(given[:2], compute_dtype), *given[2:]]
    return given, cast(rounded, torch.float64)


def module_outputs_and_grads(problem: list[torch.Tensor | None], backend: str,
                             compute_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A ResidualLayerNorm(40) holding the problem's weight and bias, under `backend` and CPU autocast to
    compute_dtype -> outputs and gradients as outputs_and_grads gives them."""
    module = ResidualLayerNorm(40)

    def layer(x, residual, weight, bias):
        with fastformer.backend(backend), torch.autocast("cpu", dtype=compute_dtype):
            return torch.func.functional_call(module, {"weight": weight, "bias": bias}, (x, residual),
                                              {"return_sum": True})

    return outputs_and_grads(layer, problem)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_module_under_autocast_keeps_the_compute_dtype(dtype, with_residual):
    """bf16 autocast, fp32 parameters, an fp32 or bf16 residual stream: y and s in bf16 (autocast alone would give
    fp32), within the 2x rule of plain bf16 PyTorch; every gradient in its leaf's dtype."""
    problem, exact_problem = autocast_problem(dtype, with_residual, torch.bfloat16)
    fused = module_outputs_and_grads(problem, "reference", torch.bfloat16)
    assert fused["y"].dtype == fused["s"].dtype == torch.bfloat16
    assert fused["dx"].dtype == dtype and fused["dweight"].dtype == fused["dbias"].dtype == torch.float32
    if with_residual:
        assert fused["dresidual"].dtype == dtype
    exact = torch_layer_norm(*exact_problem[:4])
    lowp_torch = torch_layer_norm(*cast(exact_problem[:4], torch.bfloat16))
    for name, actual, baseline, expected in zip("ys", (fused["y"], fused["s"]), lowp_torch, exact):
        assert_close_lowp(actual, baseline, expected, name)


@pytest.mark.interpreter
@pytest.mark.parametrize("with_residual", [True, False])
def test_module_under_autocast_same_dtypes_and_values_on_both_backends(with_residual, kernel_calls):
    """fp16 autocast (the interpreter cannot do bf16), fp32 inputs and parameters: the kernel's outputs and
    gradients have the reference's dtypes, and are within the 2x rule of it against fp64."""
    problem, exact_problem = autocast_problem(torch.float32, with_residual, torch.float16)
    fused = module_outputs_and_grads(problem, "triton", torch.float16)
    assert kernel_calls == {"residual_layer_norm": 1}
    reference = module_outputs_and_grads(problem, "reference", torch.float16)
    exact = outputs_and_grads(reference_layer_norm, exact_problem)
    assert fused["y"].dtype == fused["s"].dtype == torch.float16
    assert fused["dweight"].abs().min() > 0 and fused["dbias"].abs().min() > 0
    for name in fused:
        assert fused[name].dtype == reference[name].dtype, name
        assert_close_lowp(fused[name], reference[name], exact[name], name)


@pytest.mark.parametrize("norm_first", [False, True])
def test_layers_keep_the_residual_stream_in_the_autocast_dtype(norm_first):
    """An fp32 embedding into encoder and decoder layers under bf16 autocast: what each layer passes on is bf16."""
    config = TransformerConfig.tiny(37, norm_first=norm_first)
    encoder_layer, decoder_layer = EncoderLayer(config).eval(), DecoderLayer(config).eval()
    x, lengths = torch.randn(2, 5, config.d_model), torch.tensor([5, 3])
    with fastformer.backend("reference"), torch.autocast("cpu", dtype=torch.bfloat16):
        memory = encoder_layer(x, lengths)
        out = decoder_layer(x, lengths, (memory, lengths))
    assert memory.dtype == out.dtype == torch.bfloat16


# ---- torch.compile ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [True, False])
def test_torch_compile_matches_eager(with_residual):
    def layer(x, residual, weight, bias):
        return residual_layer_norm(x, residual, weight, bias, dropout_p=0.1, seed=5)

    problem = random_problem((2, 3, 40), with_residual, "both", DEVICE)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert_all_close(outputs_and_grads(compiled, problem), outputs_and_grads(layer, problem), atol=0.0, rtol=0.0)


@pytest.mark.parametrize("with_residual", [True, False])
def test_custom_op_registration(with_residual):
    """PyTorch's own checks of the schema, the fake (meta) function and the autograd registration."""
    x, residual, weight, bias, _, _ = random_problem((3, 40), with_residual, "both", DEVICE)
    leaves = [None if t is None else t.requires_grad_() for t in (x, residual, weight, bias)]
    seed = torch.tensor([5], device=DEVICE)
    torch.library.opcheck(torch.ops.fastformer.residual_layer_norm.default, (*leaves, 1e-5, 0.1, seed))


# ---- GPU: bf16/fp16 at realistic shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8192, 512), (8192, 1024), (1024, 8192)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.gpu
def test_gpu_kernel_matches_reference(dtype, shape, with_residual):
    check_kernel(shape, dtype, with_residual, "both", device="cuda")


@pytest.mark.parametrize("grad_on", ["y", "s"])
@pytest.mark.gpu
def test_gpu_kernel_one_gradient(grad_on):
    check_kernel((8192, 1024), torch.bfloat16, True, grad_on, device="cuda")


@pytest.mark.gpu
def test_gpu_backward_launches_one_wave_of_resident_programs():
    """The backward's program count comes from the compiled kernel: whole multiprocessors' worth, at most as many
    programs of 4 warps as a multiprocessor has thread slots for."""
    properties = torch.cuda.get_device_properties("cuda")
    pointer_dtypes = (torch.bfloat16,) * 4 + (torch.float32,) * 2 + (torch.bfloat16,) * 2 + (torch.float32, torch.int64)
    programs = layernorm_residual._backward_program_cap(
        torch.device("cuda", torch.cuda.current_device()), pointer_dtypes, 512, HAS_DY=True, HAS_DS_OUT=True,
        HAS_RESIDUAL=True, HAS_DROPOUT=True, BLOCK_ROWS=4, BLOCK_D=512, num_warps=4)
    sm_count = properties.multi_processor_count
    assert programs % sm_count == 0
    assert 1 <= programs // sm_count <= properties.max_threads_per_multi_processor // 128


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.gpu
def test_gpu_dropout_backward_consistent_with_forward(with_residual):
    check_dropout_consistency((4096, 1024), with_residual, device="cuda")
