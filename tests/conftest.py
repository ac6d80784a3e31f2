import os

import torch

# Triton decides at kernel-definition time whether to interpret, so this must run before any kernel module is
# imported; on a GPU machine the real compiler is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: takes minutes on a 2-core CPU")
