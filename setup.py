"""Builds fastformer and its extension fastformer._C against the torch already installed.

Install with `pip install --no-build-isolation .`: pip's isolated build environment holds no torch, and fastformer
declares none to fetch there (one from the package index would be the multi-gigabyte CUDA build, and not yours).
"""

import glob
import os
import sys

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit("fastformer compiles against the installed torch, and torch is not importable here: pip's build "
             "isolation hides it (use `pip install --no-build-isolation .`), or it is not installed (install it "
             "first: `pip install -r requirements.txt`)")

ROOT = os.path.dirname(os.path.abspath(__file__))


def extension():
    """A CUDA build where torch has CUDA and nvcc is found, a C++-only build otherwise."""
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    # No fused multiply-adds but those the loops spell out (csrc/beam_ops_cpu.inc, multiply_add): which ones a
    # compiler fuses on its own differs between versions, and with it whether a row rounds alike alone and in a batch.
    cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off"]
    link_flags = []
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        # ATen's parallel_for is a header template: without -fopenmp it runs serially inside the extension, and the
        # CPU search's groups of sentences (csrc/decoder.cpp) with it. libgomp.so.1 is torch's own at run time.
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    if sys.platform.startswith("linux"):
        # The C++ library linked in, its symbols local: against torch 2.11's CUDA build (g++ 13, the GPU machine of
        # 2026-11-27), every TORCH_CHECK that formatted an integer crashed the process: the extension's locale code
        # bound partly to copies of the library's internals inside itself and partly to the system's libstdc++.
        link_flags += ["-static-libstdc++", "-Wl,--exclude-libs,ALL"]
    if with_cuda:
        # Ampere and Hopper (sm_90a for Hopper-only instructions), unless the builder chose.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        return cpp_extension.CUDAExtension(
            "fastformer._C", cpp_sources + cuda_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("FASTFORMER_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--use_fast_math"]},
            extra_link_args=link_flags,
        )
    return cpp_extension.CppExtension(
        "fastformer._C", cpp_sources, include_dirs=[os.path.join(ROOT, "csrc")], extra_compile_args=cxx_flags,
        extra_link_args=link_flags,
    )


setup(
    name="fastformer",
    version="0.1.0",
    description="The Transformer of 'Attention Is All You Need' with fused Triton kernels and a compiled beam search",
    packages=["fastformer", "fastformer.data", "fastformer.decoding", "fastformer.nn", "fastformer.reference",
              "fastformer.training", "fastformer.translation", "triton_kernels"],
    package_data={"fastformer": ["data/corpus/*"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "triton>=3.2", "sentencepiece", "safetensors", "sacrebleu", "tqdm"],
    extras_require={"ctranslate2": ["ctranslate2>=4.0"], "tensorboard": ["tensorboard>=2.0"], "plot": ["matplotlib"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    entry_points={"console_scripts": ["fastformer=fastformer.__main__:main"]},
)
