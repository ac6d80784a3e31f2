"""Which link of an extension keeps a TORCH_CHECK with an integer from crashing? Run from any directory:

    python3 link_probe.py        # prints the torch libraries' links, then each toy variant's outcome per probe

Builds one toy extension (torch's load_inline) per link variant, in parallel, and calls each of its functions in a
process of its own: 'default' as torch links it; 'libstdcxx-first' with -lstdc++ ahead of torch's libraries;
'static-libstdcxx' with the C++ library linked in and its symbols kept local.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <torch/extension.h>
#include <sstream>
#include <string>
void check_literal() { TORCH_CHECK(false, "a literal message"); }
void check_int(int64_t n) { TORCH_CHECK(false, "an integer: ", n); }
void check_int_to_string(int64_t n) { TORCH_CHECK(false, "an integer: " + std::to_string(n)); }
std::string ostream_int(int64_t n) { std::ostringstream out; out << "an integer: " << n; return out.str(); }
"""
FUNCTIONS = {"check_literal": "", "check_int": "7", "check_int_to_string": "7", "ostream_int": "7"}
VARIANTS = {
    "default": [],
    "libstdcxx-first": ["-lstdc++"],
    "static-libstdcxx": ["-static-libstdc++", "-Wl,--exclude-libs,ALL"],
}
BUILD = """
import sys
from torch.utils.cpp_extension import load_inline
load_inline({name!r}, [{source!r}], functions={functions!r}, build_directory={directory!r},
            extra_cflags=["-O3"], extra_ldflags={flags!r})
"""
CALL = """
import sys; sys.path.insert(0, {directory!r}); import torch, {name} as toy
try:
    print("returned", repr(toy.{function}({args})))
except RuntimeError as error:
    print("raised a RuntimeError:", str(error).splitlines()[0])
"""


def shell(command: str) -> str:
    return subprocess.run(command, shell=True, capture_output=True, text=True).stdout.strip()


def build(variant: str, root: str) -> tuple[str, str, str]:
    name = "toy_" + variant.replace("-", "_")
    directory = os.path.join(root, name)
    os.makedirs(directory)
    done = subprocess.run([sys.executable, "-c", BUILD.format(name=name, source=SOURCE, functions=list(FUNCTIONS),
                                                              directory=directory, flags=VARIANTS[variant])],
                          capture_output=True, text=True)
    return name, directory, "ok" if done.returncode == 0 else "build failed: " + done.stderr[-1500:]


def main() -> None:
    import torch
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    print("torch", torch.__version__, "from", lib)
    for library in ("libc10.so", "libtorch_cpu.so", "libtorch_python.so", "libtorch.so"):
        path = os.path.join(lib, library)
        needed = shell(f"readelf -d {path} | grep NEEDED | sed 's/.*\\[//; s/\\]//' | tr '\\n' ' '")
        exported = shell(f"nm -D --defined-only {path} | grep -c ' _ZNS[iot]\\| _ZNKS[iot]\\| _ZNSt6locale'")
        print(f"{library}: NEEDED {needed}; exported std:: stream/locale symbols {exported}")
    print("libstdc++ mapped after import torch:",
          shell(f"{sys.executable} -c 'import torch; print(open(\"/proc/self/maps\").read())' | grep -o '/[^ ]*libstdc[^ ]*' | sort -u"))
    print("c++:", shell("c++ --version | head -1"), "| LDFLAGS:", os.environ.get("LDFLAGS"), "| CXXFLAGS:",
          os.environ.get("CXXFLAGS"))
    with tempfile.TemporaryDirectory() as root:
        with concurrent.futures.ThreadPoolExecutor(len(VARIANTS)) as pool:
            built = list(pool.map(lambda variant: build(variant, root), VARIANTS))
        for variant, (name, directory, status) in zip(VARIANTS, built):
            print(f"\n== {variant} ({VARIANTS[variant]}): {status}")
            if status != "ok":
                continue
            print("NEEDED:", shell(f"readelf -d {directory}/{name}.so | grep NEEDED | sed 's/.*\\[//; s/\\]//' | tr '\\n' ' '"))
            for function, args in FUNCTIONS.items():
                code = CALL.format(directory=directory, name=name, function=function, args=args)
                done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                outcome = done.stdout.strip() if done.returncode == 0 else f"process died, exit status {done.returncode}"
                print(f"  {function}({args}): {outcome}")
            if variant == "default":
                code = CALL.format(directory=directory, name=name, function="ostream_int", args="7")
                done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      env={**os.environ, "LD_DEBUG": "bindings"})
                lines = [line.split(":", 1)[-1].strip() for line in done.stderr.splitlines()
                         if name in line and any(key in line for key in ("_M_insert", "locale", "num_put", "numpunct",
                                                                        "ostringstream", "basic_ios", "ios_base"))]
                print("  bindings of the toy's stream symbols (LD_DEBUG):")
                for line in lines[:40]:
                    print("   ", line)


if __name__ == "__main__":
    main()
