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


def _child_env(unset: tuple[str, ...] = ()) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in unset}
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(str(Path(entry).resolve()) for entry in env["PYTHONPATH"].split(os.pathsep)
                                            if entry)
    # One thread per process: OpenMP threads spinning on a busy 2-core machine slow the tiny model down severalfold.
    env["OMP_NUM_THREADS"] = "1"
    return env


def _command(args: list[str], ranks: int, module: bool = True) -> list[str]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    return launcher + (["-m", "fastformer"] if module else []) + args


def start(args: list[str], scratch: Path, stderr: Path, ranks: int = 1, stdin: int | None = None) -> subprocess.Popen:
    """Starts `python -m fastformer ARGS` in the directory scratch, under torchrun when ranks > 1, unbuffered: its
    stdout is piped as text, line by line as it is written, and its stderr goes to the file stderr (stdin:
    subprocess.PIPE to write to it)."""
    with open(stderr, "wb") as error_file:
        return subprocess.Popen(_command(args, ranks), cwd=scratch, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=error_file, text=True, env={**_child_env(), "PYTHONUNBUFFERED": "1"})


def run(args: list[str], ranks: int = 1, stdin: str | bytes | None = None, timeout: float = 300,
        module: bool = True, unset_env: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python -m fastformer ARGS` (module=False: `python ARGS`), under torchrun when ranks > 1, without the
    environment variables unset_env; not checked. stdin as bytes is passed as is; stdout/stderr come back as text."""
    command = _command(args, ranks, module)
    with tempfile.TemporaryDirectory() as scratch:
        if isinstance(stdin, str):
            stdin = stdin.encode()
        done = subprocess.run(command, input=stdin, capture_output=True, timeout=timeout, cwd=scratch,
                              env=_child_env(unset_env))
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


# The main job, shortened to a fixed number of updates (so that its result does not depend on the machine's speed):
# 600 steps scored 76.0 (13a) on the first 100 test sentences on the 2-core development machine.
DEMO_STEPS = 600
DEMO_TEST_SENTENCES = 100


def run_demo(out_dir: Path) -> subprocess.CompletedProcess:
    """`fastformer demo` for DEMO_STEPS steps into out_dir, scored on the first DEMO_TEST_SENTENCES test sentences."""
    return run(["demo", "--out-dir", str(out_dir), "--minutes", "0", "--max-steps", str(DEMO_STEPS),
                "--max-sentences", str(DEMO_TEST_SENTENCES), "--valid-every", "0", "--quiet"], timeout=900)
