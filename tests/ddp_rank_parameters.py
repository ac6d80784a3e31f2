"""Run by test_train.py under torchrun: trains like `fastformer train`, then each rank saves its own parameters to
<out_dir>/rank<r>.pt, so the test can compare every rank's copy with the others and with the checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fastformer.__main__ import _exit_torchrun_worker
from fastformer.training.options import TrainOptions
from fastformer.training.trainer import Trainer


def main() -> None:
    options = TrainOptions(**json.loads(sys.argv[1]))
    trainer = Trainer(options)
    result = trainer.run()
    parameters = {name: tensor.detach().cpu() for name, tensor in trainer.model.state_dict().items()}
    torch.save({"parameters": parameters, "checkpoint": str(result.checkpoint)},
               Path(options.out_dir) / f"rank{trainer.env.rank}.pt")
    dist.destroy_process_group()
    # As the CLI's workers end: after DDP, a normal exit can abort in gloo's threads (__main__.py says why).
    _exit_torchrun_worker(None)


if __name__ == "__main__":
    main()
