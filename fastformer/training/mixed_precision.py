"""bf16 training with fp32 master weights: forward and backward run on a bf16 copy of the model, whose GEMMs read
bf16 weights directly (no autocast re-casting every weight every step), while the optimizer updates fp32 master
weights with fp32 Adam states, so that small updates are not lost to bf16 rounding.

The fp32 model stays the one that checkpoints save and validation runs: a checkpoint holds the same fp32 weights and
optimizer state as with any other precision, so runs resume across precisions.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class MasterWeights:
    """`master` (fp32: what the optimizer steps, checkpoints save and validation runs) and `compute`, a copy in
    `dtype` for the training forward and backward. The master gradients are views into one flat fp32 buffer
    (`flat_grad`), so that data parallelism all-reduces them in one call.

    A step: backward on `compute`, `accumulate_gradients()` per micro-batch, optimizer.step() on the master
    parameters, `copy_to_compute()`, `zero_grad()`.
    """

    def __init__(self, master: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.master_parameters = list(master.parameters())
        if any(parameter.dtype != torch.float32 for parameter in self.master_parameters):
            raise ValueError("MasterWeights needs a model whose parameters are all fp32")
        self.master = master
        self.compute = copy.deepcopy(master).to(dtype)
        self.compute_parameters = list(self.compute.parameters())
        device = self.master_parameters[0].device
        self.flat_grad = torch.zeros(sum(p.numel() for p in self.master_parameters), dtype=torch.float32,
                                     device=device)
        offset = 0
        for parameter in self.master_parameters:
            parameter.grad = self.flat_grad[offset:offset + parameter.numel()].view_as(parameter)
            offset += parameter.numel()

    def accumulate_gradients(self) -> None:
        """Adds the compute copy's gradients to the fp32 master gradients, then zeroes them (kept allocated, so that
        a captured graph finds them at the same addresses)."""
        pairs = [(master.grad, compute.grad) for master, compute in zip(self.master_parameters,
                                                                          self.compute_parameters)
                 if compute.grad is not None]
        if pairs:
            master_grads, compute_grads = map(list, zip(*pairs))
            torch._foreach_add_(master_grads, compute_grads)
            torch._foreach_zero_(compute_grads)

    def copy_to_compute(self) -> None:
        """compute parameters = master parameters rounded to the compute dtype."""
        with torch.no_grad():
            torch._foreach_copy_(self.compute_parameters, self.master_parameters)

    def zero_grad(self) -> None:
        self.flat_grad.zero_()
