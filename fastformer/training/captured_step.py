"""The training step replayed as CUDA graphs: one graph per bucket shape holds forward, backward and the addition of
the bf16 gradients to the fp32 master gradients; one more graph holds the update (gradient scaling, fused capturable
Adam on the masters, the copy back to the bf16 weights). A replay launches the whole step at once, so the step costs
GPU time rather than a thousand kernel launches of host time, and it never waits for the GPU.

What makes this possible: batches of a fixed set of shapes (`BucketBatchSampler`), whose ids and lengths are checked
on the CPU during collation (`TokenizedCorpus.batch`), so the step has no host sync; the dropout seeds of the Triton
kernels are drawn with torch.randint on the GPU, which a graph replays from the CUDA generator's advancing offset,
so every replay draws new masks. Gradients of data parallelism are all-reduced between the graphs (by the caller).

CUDA only: it cannot run on the CPU, and its tests are marked `gpu`.
"""

from __future__ import annotations

import torch
from torch import nn

from fastformer.data import Batch, BucketShape
from fastformer.training.gradients import clip_gradients_
from fastformer.training.mixed_precision import MasterWeights

# Eager runs of a shape (on a side stream) before its capture: Triton compiles and autotunes, cuBLAS picks its
# algorithms and allocates its workspace, the optimizer creates its states.
WARMUP_RUNS = 2


class CapturedStep:
    """micro_step(batch) per micro-batch, then (after any all-reduce of master.flat_grad) update(grad_scale).

    The first WARMUP_RUNS micro-steps of each shape, and updates, run eagerly and do their real work; the next one
    is captured and replayed, and so is every later one. Graphs share one memory pool: they never run concurrently,
    and what outlives a replay (the gradients, the loss sum, the inputs) is allocated outside the graphs.
    """

    def __init__(self, master: MasterWeights, loss_module: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, clip_norm: float = 0.0) -> None:
        if device.type != "cuda":
            raise ValueError(f"CapturedStep replays CUDA graphs: it needs a CUDA device, got {device}")
        group = optimizer.param_groups[0]
        if not (group.get("capturable") and isinstance(group["lr"], torch.Tensor)):
            raise ValueError("CapturedStep needs an optimizer built with capturable=True and a tensor lr")
        self.master = master
        self.loss_module = loss_module
        self.optimizer = optimizer
        self.device = device
        self.clip_norm = clip_norm
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)  # of the last update's gradient
        self.inputs: dict[BucketShape, tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[BucketShape, torch.cuda.CUDAGraph] = {}
        self.runs: dict[BucketShape, int] = {}
        self.update_graph: torch.cuda.CUDAGraph | None = None
        self.updates = 0

    def micro_step(self, batch: Batch) -> None:
        """Forward and backward of one batch padded to a bucket; adds its summed loss to the loss sum and its
        gradients to the master gradients."""
        shape = BucketShape(*batch.src.shape, batch.tgt_in.shape[1])
        if shape not in self.inputs:
            self.inputs[shape] = tuple(torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
                                       for tensor in batch[:5])
            self.runs[shape] = 0
        static = self.inputs[shape]
        for buffer, tensor in zip(static, batch[:5]):
            buffer.copy_(tensor.pin_memory(), non_blocking=True)
        if shape in self.graphs:
            self.graphs[shape].replay()
        elif self.runs[shape] < WARMUP_RUNS:
            self._on_side_stream(lambda: self._micro_step_body(static))
        else:
            self.graphs[shape] = self._capture(lambda: self._micro_step_body(static))
            self.graphs[shape].replay()
        self.runs[shape] += 1

    def _micro_step_body(self, static: tuple[torch.Tensor, ...]) -> None:
        loss = self.loss_module(*static)
        loss.backward()
        self.master.accumulate_gradients()
        self.loss_sum.add_(loss.detach().float())

    def update(self, grad_scale: float) -> None:
        """Scales the master gradients by grad_scale (1 / the update's target tokens), measures their norm (into
        grad_norm) and clips it to clip_norm (unless 0), steps the optimizer at its current lr tensor, copies the
        masters to the bf16 weights and zeroes the master gradients."""
        self.grad_scale.fill_(grad_scale)
        if self.update_graph is not None:
            self.update_graph.replay()
        elif self.updates < WARMUP_RUNS:
            self._on_side_stream(self._update_body)
        else:
            self.update_graph = self._capture(self._update_body)
            self.update_graph.replay()
        self.updates += 1

    def _update_body(self) -> None:
        self.master.flat_grad.mul_(self.grad_scale)
        torch.linalg.vector_norm(self.master.flat_grad, out=self.grad_norm)
        if self.clip_norm:
            clip_gradients_([self.master.flat_grad], self.clip_norm, self.grad_norm)
        self.optimizer.step()
        self.master.copy_to_compute()
        self.master.zero_grad()

    def take_loss_sum(self) -> torch.Tensor:
        """-> the summed loss of the micro-steps since the last call (a new tensor), and restarts the sum."""
        total = self.loss_sum.clone()
        self.loss_sum.zero_()
        return total

    def _on_side_stream(self, body) -> None:
        """Runs body eagerly on the side stream that captures use, as torch.cuda.graphs' warm-up asks."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            body()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _capture(self, body) -> torch.cuda.CUDAGraph:
        """-> a graph of body (captured, not run)."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.current_stream(self.device).synchronize()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            body()
        return graph
