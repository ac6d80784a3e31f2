"""The int8 headline search (64 sentences of 20 tokens, beam 4, one thread, the random base model) of two builds in
turn, each call in a process of its own (cpu_decoding.steady_headline_search, then the best of 5 searches), the
order swapped each round: whether the headline's slower reading at c79dae4 is the code or the hour.

    python headline_against_5be5a7d.py ROUNDS NAME=TREE NAME=TREE     # TREE: a checkout with its extension built
"""

import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2]
SEARCH = f'''
import sys, time
sys.path.insert(0, {str(BENCHMARKS)!r})
import cpu_decoding
translate, src = cpu_decoding.steady_headline_search(1, 64, "int8")
best = float("inf")
for _ in range(5):
    start = time.perf_counter()
    translate(src)
    best = min(best, time.perf_counter() - start)
print(best)
'''

rounds = int(sys.argv[1])
trees = dict(argument.split("=", 1) for argument in sys.argv[2:])
seconds = {name: [] for name in trees}
for r in range(rounds):
    for name, tree in list(trees.items())[::1 if r % 2 == 0 else -1]:
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", SEARCH], env=env, capture_output=True, text=True, check=True)
        seconds[name].append(float(done.stdout.split()[-1]))
        print(f"round {r + 1}: {name} {seconds[name][-1]:.4f} s", flush=True)
for name, values in seconds.items():
    print(f"{name}: median {statistics.median(values):.4f} s, best {min(values):.4f} s")
