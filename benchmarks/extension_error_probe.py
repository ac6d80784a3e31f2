"""Does an error raised in the extension's C++ reach Python as a RuntimeError? On the H200 machine (torch 2.11, its
CUDA build, g++ 13.3) every TORCH_CHECK that formatted an integer ended the process with a segmentation fault until
setup.py linked the C++ library into the extension with its symbols local (benchmarks/results/2026-11-27-nvidia-h200/).

    python benchmarks/extension_error_probe.py      # exit status 0: every probe raised; 1: one died or raised nothing

Prints the C++ compiler, the libraries the built extension links, and for each probe, in a process of its own,
whether it raised or how its process ended: an op with a bad dtype, a translate whose model has NaN weights (an
error message with an integer in it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

PROBES = {
    "op with a bad dtype": """
import torch, fastformer._C
torch.ops.fastformer.cross_attention(torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, 1, 2, 4),
                                     torch.zeros(1, 1, 2, 4), torch.ones(1, dtype=torch.int32),
                                     torch.zeros(1, dtype=torch.int32), 1)
""",
    "translate with NaN weights": """
import torch, fastformer
model = fastformer.Transformer(fastformer.TransformerConfig.tiny(50)).eval()
with torch.no_grad():
    model.output_weight[3, 0] = float("nan")
model.translate(torch.tensor([[5, 6, 2]]))
""",
}
WRAPPER = """
try:
{body}
except RuntimeError as error:
    print("raised a RuntimeError:", str(error).splitlines()[0])
else:
    print("raised nothing")
"""


def run_probe(name: str, body: str) -> bool:
    """Runs body in a process of its own, prints how it ended; -> whether it failed: its process died, or it raised
    nothing (a check that no longer fires, which would make the probe pass by testing nothing)."""
    code = WRAPPER.format(body="\n".join("    " + line for line in body.strip().splitlines()))
    failed = False
    for show in ("0", "1"):
        done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                              env={**os.environ, "TORCH_SHOW_CPP_STACKTRACES": show})
        outcome = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else \
            f"process died, exit status {done.returncode}: {done.stderr.strip().splitlines()[:1]}"
        failed |= done.returncode != 0 or outcome == "raised nothing"
        print(f"{name}, TORCH_SHOW_CPP_STACKTRACES={show}: {outcome}", flush=True)
    return failed


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for command in (["c++", "--version"], [sys.executable, "-c", "import fastformer._C as c; print(c.__file__)"]):
        done = subprocess.run(command, capture_output=True, text=True)
        print((done.stdout or done.stderr).splitlines()[0] if (done.stdout or done.stderr) else command)
        if command[0] == sys.executable and done.returncode == 0:
            print(subprocess.run(["ldd", done.stdout.strip()], capture_output=True, text=True).stdout)
    failed = False
    for name, body in PROBES.items():
        failed |= run_probe(name, body)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
