"""float32's headline search (64 sentences of 20 tokens, beam 4, THREADS threads, the random base model) at several
sizes of the logits' blocks, in one process (logits_block_trial.patch reads the size at each step from
FASTFORMER_TRIAL_BLOCK_MIB): each round, in an order rotated a round, an untimed then a timed search at each size;
each size's median and its time over the first size's, round by round.

    PYTHONPATH=<logits_block_trial.patch's build> python logits_block_trial.py THREADS MIB,MIB,... ROUNDS
"""

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding  # noqa: E402

threads, sizes, rounds = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
translate, src = cpu_decoding.steady_headline_search(threads, 64, "float32")
seconds = {size: [] for size in sizes}
for r in range(rounds):
    for size in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
        os.environ["FASTFORMER_TRIAL_BLOCK_MIB"] = size
        translate(src)
        start = time.perf_counter()
        translate(src)
        seconds[size].append(time.perf_counter() - start)
    print(f"round {r + 1}: " + " ".join(f"{size} MiB {seconds[size][-1]:.3f} s" for size in sizes), flush=True)
for size in sizes:
    ratios = [a / b for a, b in zip(seconds[size], seconds[sizes[0]])]
    print(f"{size} MiB: median {statistics.median(seconds[size]):.4f} s, time over {sizes[0]} MiB "
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
