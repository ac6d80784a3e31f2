"""Greedy search against sampling from the top 2 and the top 10 (int8, 64 sentences of 20 tokens, 30 target tokens
each, the random base model with a 37k vocabulary), the three calls in turn in one process for ROUNDS rounds after
four warm-up calls each: each system's best and median, and its speed against greedy search's, the median of the
rounds' ratios. Sampling's extra work is the top-k kept in the output projection's GEMM and the draw.

    PYTHONPATH=<a build's checkout> python sampling_by_k.py THREADS ROUNDS
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402

threads, rounds = int(sys.argv[1]), int(sys.argv[2])
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
target_tokens = cpu_options.TARGET_TOKENS


def system(**options):
    def run() -> None:
        model.translate(src, beam_size=1, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                        min_len=model.config.max_positions, compute_type="int8", return_scores=False, **options)
    return run


systems = {"greedy": system(), "top-2 sampling": system(sampling_topk=2, seed=1),
           "top-10 sampling": system(sampling_topk=10, seed=1)}
for run in systems.values():
    for _ in range(4):
        run()
seconds = {name: [] for name in systems}
for _ in range(rounds):
    for name, run in systems.items():
        start = time.perf_counter()
        run()
        seconds[name].append(time.perf_counter() - start)
for name, times in seconds.items():
    speed = statistics.median(g / s for g, s in zip(seconds["greedy"], times))
    print(f"{name}: best {min(times):.4f} s, median {statistics.median(times):.4f} s, speed against greedy {speed:.3f}")
