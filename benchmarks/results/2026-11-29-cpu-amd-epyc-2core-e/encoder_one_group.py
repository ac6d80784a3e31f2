"""The compiled int8 encoder of the headline's sources (64 sentences of 20 tokens and EOS, the random base model)
on 2 threads, against one group's half (32 sentences) on 1 thread: what each thread of the two-thread search would
take, were each to encode its own group. Best of 15 calls after 3, three rounds.

    PYTHONPATH=<a build's checkout> python encoder_one_group.py
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402
from fastformer.decoding import search  # noqa: E402

model, src = cpu_options.model_and_sources(argparse.Namespace(threads=2, seed=0, shape="b", vocab=37000))
compiled = search.model_compiled(model, "int8")


def best_seconds(sources: torch.Tensor, threads: int, calls: int = 15) -> float:
    torch.set_num_threads(threads)
    with torch.inference_mode():
        for _ in range(3):
            search.encode(model, sources, compiled)
        best = float("inf")
        for _ in range(calls):
            start = time.perf_counter()
            search.encode(model, sources, compiled)
            best = min(best, time.perf_counter() - start)
    return best


for _ in range(3):
    both, one = best_seconds(src, 2), best_seconds(src[:32], 1)
    print(f"64 sentences on 2 threads {both * 1e3:.1f} ms; 32 on 1 thread {one * 1e3:.1f} ms; ratio {both / one:.3f}")
