"""The 37k output projection's summaries (PackedLinear.summarize) on one thread, the tile before f42f55c and the one
of f42f55c in turn, call by call in one process: FASTFORMER_OFFER_TRIAL picks the tile in a build of f42f55c with
offer_trial.patch applied. Top-1 (greedy search), top-10 (top-10 sampling), top-8 with the log-softmax terms (beam 4),
top-16 and top-32; ROWS rows of random inputs; weights from L3 (one 19 MB copy) or from memory (two copies called in
turn); 60 rounds; each pair's medians in ms and the ratio of the medians (new over old).

    PYTHONPATH=<the patched build> python offer_trial_projection.py ROWS {L3,mem}
"""

import os
import statistics
import sys
import time

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
rows, source = int(sys.argv[1]), sys.argv[2]
generator = torch.Generator().manual_seed(0)
copies = 2 if source == "mem" else 1
projections = [extension().PackedLinear(torch.randn(37000, 512, generator=generator) * 512 ** -0.5,
                                        torch.zeros(37000), 8, "int8", True) for _ in range(copies)]
x = torch.randn(rows, 512, generator=generator)
tiles = {"before": "0", "f42f55c": "1"}
summaries = [(1, False), (10, False), (8, True), (16, False), (32, False)]
ms = {(tile, summary): [] for tile in tiles for summary in summaries}
for _ in range(60):
    for tile, mode in tiles.items():
        os.environ["FASTFORMER_OFFER_TRIAL"] = mode
        for k, log_totals in summaries:
            start = time.perf_counter()
            for projection in projections:
                projection.summarize(x, k, [0, 1], log_totals=log_totals)
            ms[(tile, (k, log_totals))].append((time.perf_counter() - start) / len(projections) * 1e3)
for k, log_totals in summaries:
    before, after = (statistics.median(ms[(tile, (k, log_totals))]) for tile in tiles)
    print(f"{rows} rows from {source}, top-{k}{' and log terms' if log_totals else ''}: before {before:.3f} ms, "
          f"f42f55c {after:.3f} ms, ratio {after / before:.3f}")
