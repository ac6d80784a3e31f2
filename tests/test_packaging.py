"""The source distribution against the tree: it holds every file a build from it reads (the extension's sources,
headers, included loops and CUDA kernels, the CMake build and its test, the pinned requirements, the bundled corpus),
so that `pip install` of the sdist (or `python -m build`, which goes through one) compiles."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_sdist_holds_every_file_a_build_reads(tmp_path: Path):
    listed = subprocess.run(["git", "ls-files", "csrc", "CMakeLists.txt", "requirements.txt", "fastformer/data/corpus"],
                            cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    needed = set(listed.stdout.split())
    assert any(name.endswith(".h") for name in needed) and any(name.endswith(".cu") for name in needed)
    # From a copy of the tree git shows (tracked and new files): a checkout's fastformer.egg-info/SOURCES.txt, left
    # by an earlier build, would feed the sdist what MANIFEST.in does not.
    tree = tmp_path / "tree"
    shown = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in shown:
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    done = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path), "--formats=gztar"],
                          cwd=tree, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (archive,) = tmp_path.glob("fastformer-*.tar.gz")
    with tarfile.open(archive) as tar:
        held = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert sorted(needed - held) == []
