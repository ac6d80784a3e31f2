"""Host-side helpers shared by the ops' launchers: grid arithmetic and the dropout seeds.

cdiv and next_power_of_2 are plain Python: triton.cdiv and triton.next_power_of_2 also accept constexprs, which
costs about 1.5 us a call on the host, several times per launch."""

from typing import Optional

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def dropout_scale(dropout_p: float) -> float:
    """What kept elements are multiplied by, so that dropout leaves the expectation unchanged."""
    return 1.0 / (1.0 - dropout_p)


def seed_tensor(seed: Optional[int], dropout_p: float, device: torch.device) -> Optional[torch.Tensor]:
    """-> the [1] int64 Philox seed the kernels read on `device` (None without dropout): `seed`, or one drawn from
    torch's generator of that device. Drawing it there needs no host sync, and a captured CUDA graph redraws it on
    every replay, so no two steps share a dropout mask."""
    if dropout_p == 0.0:
        return None
    if seed is None:
        return torch.randint(0, 2**31 - 1, (1,), device=device)
    return torch.full((1,), seed, dtype=torch.int64, device=device)
