"""The beam-4 search of SENTENCES 20-token sources (cpu_decoding.py's headline point) on THREADS threads, in
COMPUTE_TYPE (int8 unless given), after its steady state: prints "steady", waits for the file GO to exist, then runs
CALLS searches, prints their mean time and waits 2 s. profile_threads.sh profiles those calls alone, without the
model's set-up or the exit.

    PYTHONPATH=<a build's checkout> python search_calls.py THREADS SENTENCES CALLS GO [COMPUTE_TYPE]
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding  # noqa: E402

threads, sentences, calls, go = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
compute_type = sys.argv[5] if len(sys.argv) > 5 else "int8"
translate, src = cpu_decoding.steady_headline_search(threads, sentences, compute_type)
print("steady", flush=True)
while not os.path.exists(go):
    time.sleep(0.05)
start = time.perf_counter()
for _ in range(calls):
    translate(src)
print(f"threads={threads} sentences={sentences}: {(time.perf_counter() - start) / calls:.4f} s a search", flush=True)
time.sleep(2)  # for a profiler to stop before the interpreter's exit, whose collection of every object it would count
