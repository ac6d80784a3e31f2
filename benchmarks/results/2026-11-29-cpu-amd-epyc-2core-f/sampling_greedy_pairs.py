"""Top-10 sampling against greedy search alone, in pairs: cpu_options.py's point (int8, the random base model with a
37k vocabulary, 64 sentences of 20 tokens, 31 target tokens each, so both do the same steps) on THREADS threads,
the two calls of a round in turn, which goes first alternating round by round, nothing else called in the process
-> per round greedy's seconds over sampling's (> 1: sampling faster); their median and range, as JSON on stdout.

    OMP_NUM_THREADS=2 python sampling_greedy_pairs.py THREADS ROUNDS
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402

threads, rounds = int(sys.argv[1]), int(sys.argv[2])
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
target_tokens = cpu_options.TARGET_TOKENS


def search(**options):
    def run() -> float:
        start = time.perf_counter()
        model.translate(src, beam_size=1, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                        min_len=model.config.max_positions, compute_type="int8", return_scores=False, **options)
        return time.perf_counter() - start
    return run


greedy, sampling = search(), search(sampling_topk=cpu_options.TOP_K, seed=1)
for _ in range(5):
    greedy(), sampling()
ratios, greedy_seconds, sampling_seconds = [], [], []
for round_index in range(rounds):
    if round_index % 2:
        s, g = sampling(), greedy()
    else:
        g, s = greedy(), sampling()
    greedy_seconds.append(g), sampling_seconds.append(s), ratios.append(g / s)
print(json.dumps({"threads": threads, "rounds": rounds,
                  "greedy_over_sampling_median": round(statistics.median(ratios), 4),
                  "min": round(min(ratios), 4), "max": round(max(ratios), 4),
                  "sampling_faster_rounds": sum(r > 1 for r in ratios),
                  "greedy_median_s": round(statistics.median(greedy_seconds), 4),
                  "sampling_median_s": round(statistics.median(sampling_seconds), 4)}), flush=True)
