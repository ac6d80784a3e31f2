import collections
import functools
import importlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton decides at kernel-definition time whether to interpret, so this must run before any kernel module is
# imported; on a GPU machine the real compiler is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The Triton entry points fastformer.dispatch calls, by module. dispatch imports them at call time, so replacing the
# module attribute reaches every call made through the backend switch.
KERNEL_ENTRY_POINTS = {"triton_kernels.attention": ("flash_attention",),
                       "triton_kernels.cross_entropy": ("cross_entropy", "linear_cross_entropy"),
                       "triton_kernels.layernorm_residual": ("residual_layer_norm",)}


pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tests (modules name it in `pytestmark`): their models are tiny."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """fastformer_process.run_demo -> (its out-dir, the finished process). Minutes on a 2-core CPU: trained once for
    the tests that need a model that translates well."""
    from fastformer_process import run_demo

    out_dir = tmp_path_factory.mktemp("demo") / "demo"
    done = run_demo(out_dir)
    assert done.returncode == 0, done.stderr
    return out_dir, done


@pytest.fixture(autouse=True, scope="session")
def prepared_corpus_cache(tmp_path_factory) -> None:
    """Corpora the tests prepare (fastformer.data.prepared) go to a temporary cache, not the user's ~/.cache; child
    processes inherit it."""
    os.environ["FASTFORMER_CACHE"] = str(tmp_path_factory.mktemp("fastformer-cache"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: takes minutes on a 2-core CPU")
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU tensors, which needs Triton's "
                                       "interpreter; skipped on a GPU machine, whose `gpu` tests run those kernels")


def pytest_collection_modifyitems(config, items):
    """The `gpu` and `interpreter` markers' skips: the one place that decides which of them run."""
    if torch.cuda.is_available():
        marker, skip = "interpreter", pytest.mark.skip(reason="runs Triton on CPU tensors: needs the interpreter")
    else:
        marker, skip = "gpu", pytest.mark.skip(reason="gpu test: needs a CUDA device")
    for item in items:
        if item.get_closest_marker(marker) is not None:
            item.add_marker(skip)


@pytest.fixture
def kernel_calls(monkeypatch) -> collections.Counter:
    """Counts the calls of each Triton entry point ({"flash_attention": 2, ...}), so that a test comparing the
    "triton" backend against the reference proves the kernels ran rather than the reference twice."""
    calls: collections.Counter = collections.Counter()
    for module_name, names in KERNEL_ENTRY_POINTS.items():
        module = importlib.import_module(module_name)
        for name in names:
            monkeypatch.setattr(module, name, _counted(getattr(module, name), name, calls))
    return calls


def _counted(function, name: str, calls: collections.Counter):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)
    return wrapper
