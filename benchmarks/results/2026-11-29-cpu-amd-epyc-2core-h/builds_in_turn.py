"""A search at cpu_options.py's point (base model, 37k vocabulary, 64 sentences of 20 tokens, 31 target tokens
each) with two builds, each in processes of its own, in turn (which goes first alternating), ROUNDS rounds -> each
build's median seconds and the second's time over the first's, round by round. A process times the best of 5
searches after 4 untimed.

    python builds_in_turn.py BEFORE AFTER THREADS TYPE BEAM ROUNDS

BEFORE, AFTER: checkouts with the extension built in place (python setup.py build_ext --inplace). TYPE: int8 or
float32. BEAM 1 is greedy search (no scores); more, a beam search returning scores.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def best_search_seconds(threads: int, compute_type: str, beam: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
    import cpu_options

    model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
    target_tokens = cpu_options.TARGET_TOKENS

    def search() -> float:
        start = time.perf_counter()
        model.translate(src, beam_size=beam, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                        min_len=model.config.max_positions, compute_type=compute_type, return_scores=beam > 1)
        return time.perf_counter() - start

    for _ in range(4):
        search()
    return min(search() for _ in range(5))


if sys.argv[1] == "--worker":
    print(best_search_seconds(int(sys.argv[2]), sys.argv[3], int(sys.argv[4])))
    sys.exit()
before, after, threads, compute_type, beam, rounds = sys.argv[1:3] + sys.argv[3:7]
seconds = {before: [], after: []}
for r in range(int(rounds)):
    for build in (before, after) if r % 2 == 0 else (after, before):
        env = dict(os.environ, PYTHONPATH=build, OMP_NUM_THREADS=threads)
        out = subprocess.run([sys.executable, __file__, "--worker", threads, compute_type, beam], env=env, check=True,
                             capture_output=True, text=True).stdout
        seconds[build].append(float(out))
ratios = [a / b for a, b in zip(seconds[after], seconds[before])]
print(f"{threads} threads, {compute_type}, beam {beam}: before {statistics.median(seconds[before]):.4f} s, after "
      f"{statistics.median(seconds[after]):.4f} s; after / before round by round: median {statistics.median(ratios):.4f} "
      f"[{min(ratios):.4f}, {max(ratios):.4f}]", flush=True)
