"""Tolerances for every parity test, in one place."""

import torch

# fp32 parity: fused kernels reorder sums, so a few ulps of relative error are expected.
FP32 = dict(atol=1e-5, rtol=1e-4)

# Floor for the low-precision rule, so an exact 0-vs-0 comparison does not demand a zero error.
LOWP_FLOOR = 1e-6


def max_abs_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest |x - reference|, computed in fp64."""
    return (x.double() - reference.double()).abs().max().item()


def assert_close_lowp(fused: torch.Tensor, lowp_torch: torch.Tensor, reference: torch.Tensor, name: str = "") -> None:
    """flash-attention's rule: the fused result's error against an fp32/fp64 reference is at most twice that of
    plain PyTorch run in the same low precision."""
    assert torch.isfinite(fused).all(), f"{name}: non-finite values"
    fused_error = max_abs_error(fused, reference)
    torch_error = max_abs_error(lowp_torch, reference)
    assert fused_error <= 2 * torch_error + LOWP_FLOOR, (
        f"{name}: fused error {fused_error:.3e} > 2 x PyTorch's {torch_error:.3e}"
    )
