"""Which build setting turns a C++ exception into a segfault? Builds four tiny extensions (C++ only / with a .cu,
each with and without -fopenmp), then calls throwing functions of each in a process of its own."""
import os, subprocess, sys, textwrap
from concurrent.futures import ThreadPoolExecutor

CPP = r'''
#include <torch/extension.h>
#include <stdexcept>
void throw_check(int64_t n) { TORCH_CHECK(n > 0, "n must be positive, got ", n); }
void throw_std() { throw std::runtime_error("std error"); }
int64_t omp_threads();
at::Tensor op_check(const at::Tensor& t) { TORCH_CHECK(t.dtype() == at::kFloat, "float only"); return t; }
TORCH_LIBRARY(NAME, m) { m.def("op_check(Tensor t) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAME, CPU, m) { m.impl("op_check", &op_check); }
'''
CU = r'''
__global__ void noop_kernel(float* x) { if (x) x[0] = 1.f; }
void launch_noop() { noop_kernel<<<1, 1>>>(nullptr); }
'''
VARIANTS = {"cpu": (False, False), "cpu_omp": (False, True), "cuda": (True, False), "cuda_omp": (True, True)}


def build(name):
    with_cuda, omp = VARIANTS[name]
    code = textwrap.dedent(f'''
        import torch
        from torch.utils.cpp_extension import load_inline
        import os
        os.makedirs("/tmp/ext_exp/{name}", exist_ok=True)
        load_inline("exp_{name}", [{CPP.replace("NAME", "exp_" + name)!r} + "int64_t omp_threads() {{ return 0; }}"],
                    cuda_sources={[CU] if with_cuda else None!r}, functions=["throw_check", "throw_std"],
                    with_cuda={with_cuda}, extra_cflags={["-O3", "-fopenmp"] if omp else ["-O3"]!r},
                    extra_ldflags={["-fopenmp"] if omp else []!r}, build_directory="/tmp/ext_exp/{name}",
                    verbose=False)
        print("built")
    ''')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return name, done.returncode, (done.stdout + done.stderr)[-600:]


def probe(name, call):
    code = textwrap.dedent(f'''
        import sys, torch
        sys.path.insert(0, "/tmp/ext_exp/{name}")
        import exp_{name} as m
        try:
            {call}
        except Exception as e:
            print("raised", type(e).__name__, str(e).splitlines()[0][:80])
        else:
            print("no error")
    ''')
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True)
    out = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else [f"died rc={done.returncode}"]
    return f"{name:9s} {call:55s} {out[0] if out else ''}"


with ThreadPoolExecutor(4) as pool:
    for name, rc, tail in pool.map(build, VARIANTS):
        print("build", name, "rc", rc, "" if rc == 0 else tail)
for name in VARIANTS:
    for call in ("m.throw_check(-1)", "m.throw_std()",
                 f"torch.ops.exp_{name}.op_check(torch.zeros(2, dtype=torch.float64))"):
        print(probe(name, call), flush=True)
