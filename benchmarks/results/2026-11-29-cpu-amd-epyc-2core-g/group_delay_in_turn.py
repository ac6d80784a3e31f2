"""The int8 search at cpu_options.py's point (64 sentences, BEAM) on 2 threads with the second group of sentences
started DELAY microseconds late (group_delay_trial.patch reads FASTFORMER_TRIAL_GROUP_DELAY_US), so that the two
groups' attention would not read memory at the same time, against no delay: in turn in one process, which goes first
alternating, ROUNDS rounds -> per delay the median of delayed over plain seconds.

    OMP_NUM_THREADS=2 PYTHONPATH=<a tree with the patch> python group_delay_in_turn.py DELAY[,DELAY...] ROUNDS BEAM
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402

delays, rounds, beam = [int(d) for d in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3])
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=2, seed=0, shape="b", vocab=37000))
target_tokens = cpu_options.TARGET_TOKENS


def search(delay: int) -> float:
    if delay:
        os.environ["FASTFORMER_TRIAL_GROUP_DELAY_US"] = str(delay)
    else:
        os.environ.pop("FASTFORMER_TRIAL_GROUP_DELAY_US", None)
    start = time.perf_counter()
    model.translate(src, beam_size=beam, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                    min_len=model.config.max_positions, compute_type="int8", return_scores=beam > 1)
    return time.perf_counter() - start


for _ in range(4):
    search(0)
ratios = {delay: [] for delay in delays}
for round_index in range(rounds):
    for delay in delays:
        if round_index % 2:
            delayed, plain = search(delay), search(0)
        else:
            plain, delayed = search(0), search(delay)
        ratios[delay].append(delayed / plain)
for delay, values in ratios.items():
    print(f"beam {beam}, delay {delay} us: delayed/plain median {statistics.median(values):.4f} "
          f"(min {min(values):.4f}, max {max(values):.4f}), delayed faster in {sum(v < 1 for v in values)}/"
          f"{len(values)}", flush=True)
