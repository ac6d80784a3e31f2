"""The torch version check at import, and that it checks the version setup.py declares."""

import pathlib
import re

import pytest

from fastformer.torch_version import MIN_TORCH, check_torch_version


def test_setup_declares_the_version_the_import_checks():
    setup = (pathlib.Path(__file__).parent.parent / "setup.py").read_text()
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', setup)
    assert declared is not None, "setup.py's install_requires has no torch>=X.Y"
    assert (int(declared[1]), int(declared[2])) == MIN_TORCH


@pytest.mark.parametrize("version", ["2.5.1", "2.5.1+cu124", "1.13.0", "not a version"])
def test_older_torch_is_refused_with_both_versions(version):
    minimum = re.escape(".".join(map(str, MIN_TORCH)))
    with pytest.raises(ImportError, match=rf"needs torch >= {minimum}; this is torch {re.escape(version)}$"):
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.11.0+cu130", "2.13.0+cpu", "3.0.0a0"])
def test_supported_torch_passes(version):
    check_torch_version(version)
