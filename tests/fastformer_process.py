"""Runs `python -m fastformer ...` (or a script) in a child process, alone or under torchrun, for the CLI tests.

The child starts in a scratch directory, not the repository root: `python -m` puts its working directory first on
sys.path, and in CI's fresh clone the source tree has no compiled extension, so it must not shadow the installed
package. A relative PYTHONPATH (the source-tree runs use `PYTHONPATH=.:tests`) is made absolute for the same reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(str(Path(entry).resolve()) for entry in env["PYTHONPATH"].split(os.pathsep)
                                            if entry)
    # One thread per process: OpenMP threads spinning on a busy 2-core machine slow the tiny model down severalfold.
    env["OMP_NUM_THREADS"] = "1"
    return env


def run(args: list[str], ranks: int = 1, stdin: str | None = None, timeout: float = 300,
        module: bool = True) -> subprocess.CompletedProcess:
    """`python -m fastformer ARGS` (module=False: `python ARGS`), under torchrun when ranks > 1; not checked."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    command = launcher + (["-m", "fastformer"] if module else []) + args
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=scratch,
                              env=_child_env())
