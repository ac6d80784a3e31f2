"""Run by test_clip_norm.py, alone or under torchrun: trains like `fastformer train --clip-norm`, recording on each
rank, for every update, the gradients before and after fastformer clipped them and the norm it clipped by, to
<out_dir>/clip_rank<r>.pt, so the test can clip the same gradients with torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fastformer.__main__ import _exit_torchrun_worker
from fastformer.training import gradients
from fastformer.training.options import TrainOptions
from fastformer.training.trainer import Trainer


def main() -> None:
    options = TrainOptions(**json.loads(sys.argv[1]))
    updates = []
    clip = gradients.clip_gradients_

    def recording_clip(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
        before = [gradient.clone() for gradient in grads]
        clip(grads, max_norm, total_norm)
        updates.append({"before": before, "after": [gradient.clone() for gradient in grads],
                        "norm": total_norm.clone()})

    gradients.clip_gradients_ = recording_clip
    trainer = Trainer(options)
    trainer.run()
    torch.save(updates, Path(options.out_dir) / f"clip_rank{trainer.env.rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
        # As the CLI's workers end: after DDP, a normal exit can abort in gloo's threads (__main__.py says why).
        _exit_torchrun_worker(None)


if __name__ == "__main__":
    main()
