"""The headline's GEMM floor two ways beside its search, in one process: cpu_decoding.py's floor before BEFORE (each
shape's calls back to back through one layer's weights) and its floor now (the search's order, each layer's own
weights), at THREADS threads in COMPUTE_TYPE, the three timed in turn PAIRS times (which goes first rotating) once
the search is steady -> the best of each, and the search's share of each floor, as JSON on stdout.

    OMP_NUM_THREADS=2 PYTHONPATH=. python floors_side_by_side.py BEFORE THREADS COMPUTE_TYPE PAIRS
"""
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

benchmarks = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(benchmarks))
import cpu_decoding as now  # noqa: E402

before_commit, threads, compute_type, pairs = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
source = subprocess.run(["git", "show", f"{before_commit}:benchmarks/cpu_decoding.py"], cwd=benchmarks,
                        capture_output=True, text=True, check=True).stdout
before = types.ModuleType("cpu_decoding_before")
sys.modules[before.__name__] = before  # its dataclasses look their module up
exec(compile(source, f"{before_commit}:benchmarks/cpu_decoding.py", "exec"), before.__dict__)

n_sentences = 64
point = now.Point(threads, 4, 20, (n_sentences,))
translate, src = now.steady_headline_search(threads, n_sentences, compute_type)
torch.manual_seed(0)
model = now.Transformer(now.shape_config("b", 37000)).eval()
floors = {"floor_before": before.gemm_floor(model, compute_type, point, n_sentences),
          "floor_now": now.gemm_floor(model, compute_type, point, n_sentences)}


def search() -> float:
    start = time.perf_counter()
    translate(src)
    return time.perf_counter() - start


calls = {**floors, "search": search}
seconds = {name: [] for name in calls}
names = list(calls)
for index in range(pairs):
    for name in names[index % 3:] + names[:index % 3]:
        torch.set_num_threads(threads)
        seconds[name].append(calls[name]())
best = {name: min(values) for name, values in seconds.items()}
print(json.dumps({"threads": threads, "compute_type": compute_type, "pairs": pairs, "before": before_commit,
                  **{f"{name}_best_s": round(value, 4) for name, value in best.items()},
                  "share_of_floor_before": round(best["floor_before"] / best["search"], 3),
                  "share_of_floor_now": round(best["floor_now"] / best["search"], 3)}), flush=True)
