"""Two groups of sentences (one a thread, each with single-threaded GEMMs: the search's way) against one group whose
GEMMs split over both threads, switched in one process by one_group_trial.patch's FF_ONE_GROUP: cpu_options.py's
point (the random base model with a 37k vocabulary, sources of 20 tokens, 31 target tokens each) on two threads,
SENTENCES (64 unless given: cpu_options.py's own; more are drawn alike), BEAM and COMPUTE_TYPE, the two in turn, which goes first alternating, ROUNDS rounds after 3 -> per round the one-group
search's seconds over the two-group search's (< 1: one group faster); the median and range, as JSON.

    OMP_NUM_THREADS=2 PYTHONPATH=<a build with the patch> python one_group_switch.py BEAM COMPUTE_TYPE ROUNDS [SENTENCES]
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402

beam, compute_type, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
n_sentences = int(sys.argv[4]) if len(sys.argv) > 4 else cpu_options.SENTENCES
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=2, seed=0, shape="b", vocab=37000))
if n_sentences != cpu_options.SENTENCES:
    src = cpu_options.sources(model.config, n_sentences, cpu_options.SOURCE_TOKENS, 0)
target_tokens = cpu_options.TARGET_TOKENS


def search(one_group: bool) -> float:
    os.environ["FF_ONE_GROUP"] = "1" if one_group else "0"
    start = time.perf_counter()
    model.translate(src, beam_size=beam, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                    min_len=model.config.max_positions, compute_type=compute_type, return_scores=beam > 1)
    return time.perf_counter() - start


for _ in range(3):
    search(False), search(True)
ratios, two, one = [], [], []
for round_index in range(rounds):
    if round_index % 2:
        o, t = search(True), search(False)
    else:
        t, o = search(False), search(True)
    two.append(t), one.append(o), ratios.append(o / t)
print(json.dumps({"sentences": n_sentences, "beam": beam, "compute_type": compute_type, "rounds": rounds,
                  "one_over_two_median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
                  "max": round(max(ratios), 4), "two_groups_median_s": round(statistics.median(two), 4),
                  "one_group_median_s": round(statistics.median(one), 4)}), flush=True)
