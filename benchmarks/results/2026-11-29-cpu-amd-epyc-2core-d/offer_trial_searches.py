"""Greedy search, top-10 sampling and beam 4 (int8, 64 sentences of 20 tokens, 30 target tokens each, the random base
model with a 37k vocabulary, THREADS threads), each with the tile before f42f55c and the one of f42f55c in turn, in
one process (FASTFORMER_OFFER_TRIAL, in a build of f42f55c with offer_trial.patch applied; the order of the pair
swapped every round), for ROUNDS rounds after three warm-up calls of each: medians, the median of the rounds'
time ratios (new over old), and top-10 sampling's speed against greedy search's with each tile.

    OMP_NUM_THREADS=THREADS PYTHONPATH=<the patched build> python offer_trial_searches.py THREADS ROUNDS
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402

threads, rounds = int(sys.argv[1]), int(sys.argv[2])
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
target_tokens = cpu_options.TARGET_TOKENS


def system(beam_size, **options):
    def run() -> None:
        model.translate(src, beam_size=beam_size, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                        min_len=model.config.max_positions, compute_type="int8", **options)
    return run


systems = {"greedy": system(1, return_scores=False),
           "top-10 sampling": system(1, return_scores=False, sampling_topk=10, seed=1),
           "beam 4": system(4, length_penalty=0.6)}
tiles = {"before": "0", "f42f55c": "1"}
for run in systems.values():
    for mode in tiles.values():
        os.environ["FASTFORMER_OFFER_TRIAL"] = mode
        for _ in range(3):
            run()
seconds = {(name, tile): [] for name in systems for tile in tiles}
for round_ in range(rounds):
    for name, run in systems.items():
        for tile in (list(tiles) if round_ % 2 == 0 else list(tiles)[::-1]):
            os.environ["FASTFORMER_OFFER_TRIAL"] = tiles[tile]
            start = time.perf_counter()
            run()
            seconds[(name, tile)].append(time.perf_counter() - start)
for name in systems:
    before, after = seconds[(name, "before")], seconds[(name, "f42f55c")]
    ratio = statistics.median(a / b for a, b in zip(after, before))
    print(f"{name}: before {statistics.median(before):.4f} s, f42f55c {statistics.median(after):.4f} s, "
          f"time ratio {ratio:.3f}")
for tile in tiles:
    speed = statistics.median(g / s for g, s in zip(seconds[("greedy", tile)], seconds[("top-10 sampling", tile)]))
    print(f"top-10 sampling's speed against greedy search's, tile {tile}: {speed:.3f}")
