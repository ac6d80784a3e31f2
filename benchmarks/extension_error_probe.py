"""Does an error raised in the extension's C++ reach Python as a RuntimeError? On the H200 of 2026-11-26 (torch 2.11,
its CUDA build, g++ 13.3) some ended the process with a segmentation fault instead; the CPU build raises them all.

    python benchmarks/extension_error_probe.py      # exit status 0: every probe raised; 1: a probe's process died

Prints the C++ compiler, the libraries the built extension links, and for each probe, in a process of its own,
whether it raised or how its process ended: fastformer's own (an op with a bad dtype, a translate whose model has NaN
weights), then a toy extension's (built with torch's load_inline), which tell what the crash needs. What that H200
showed: TORCH_CHECKs with a literal message or a dtype in it raised; those with an integer in their message crashed,
in a torch op and in a pybind11 function alike; a std::runtime_error raised; a module-local pybind11 translator of
c10::Error changed nothing (so the crash is before translation).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

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
# The toy's functions split where the crash could be: the throw, c10::str's formatting, the C++ library's.
TOY_SOURCE = r"""
#include <torch/extension.h>
#include <sstream>
#include <stdexcept>
void check_literal() { TORCH_CHECK(false, "a literal message"); }
void check_int(int64_t n) { TORCH_CHECK(false, "an integer: ", n); }
void check_string(const std::string& s) { TORCH_CHECK(false, "a string: ", s); }
std::string c10_str_int(int64_t n) { return c10::str("an integer: ", n); }
std::string ostream_int(int64_t n) { std::ostringstream out; out << "an integer: " << n; return out.str(); }
void throw_std_int(int64_t n) { throw std::runtime_error(ostream_int(n)); }
"""
TOY_FUNCTIONS = ["check_literal", "check_int", "check_string", "c10_str_int", "ostream_int", "throw_std_int"]
TOY_PROBES = {name: f"import sys; sys.path.insert(0, {{directory!r}}); import torch, fastformer_error_toy as toy; "
                    f"print(toy.{name}({args}))"
              for name, args in (("check_literal", ""), ("check_int", "7"), ("check_string", "'seven'"),
                                 ("c10_str_int", "7"), ("ostream_int", "7"), ("throw_std_int", "7"))}
WRAPPER = """
try:
{body}
except RuntimeError as error:
    print("raised a RuntimeError:", str(error).splitlines()[0])
else:
    print("raised nothing")
"""


def run_probe(name: str, body: str) -> bool:
    """Runs body in a process of its own, prints how it ended; -> whether that process died."""
    code = WRAPPER.format(body="\n".join("    " + line for line in body.strip().splitlines()))
    crashed = False
    for show in ("0", "1"):
        done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                              env={**os.environ, "TORCH_SHOW_CPP_STACKTRACES": show})
        outcome = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else \
            f"process died, exit status {done.returncode}: {done.stderr.strip().splitlines()[:1]}"
        crashed |= done.returncode != 0
        print(f"{name}, TORCH_SHOW_CPP_STACKTRACES={show}: {outcome}", flush=True)
    return crashed


def build_toy(directory: str) -> None:
    from torch.utils.cpp_extension import load_inline
    load_inline("fastformer_error_toy", [TOY_SOURCE], functions=TOY_FUNCTIONS, build_directory=directory,
                extra_cflags=["-O3"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-toy", action="store_true", help="skip the toy extension (a ~30 s build)")
    args = parser.parse_args()
    for command in (["c++", "--version"], [sys.executable, "-c", "import fastformer._C as c; print(c.__file__)"]):
        done = subprocess.run(command, capture_output=True, text=True)
        print((done.stdout or done.stderr).splitlines()[0] if (done.stdout or done.stderr) else command)
        if command[0] == sys.executable and done.returncode == 0:
            print(subprocess.run(["ldd", done.stdout.strip()], capture_output=True, text=True).stdout)
    crashed = False
    for name, body in PROBES.items():
        crashed |= run_probe(name, body)
    if not args.no_toy:
        with tempfile.TemporaryDirectory() as directory:
            build_toy(directory)
            for name, body in TOY_PROBES.items():
                crashed |= run_probe(f"toy {name}", body.format(directory=directory))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
