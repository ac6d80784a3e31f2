"""The int8 beam-4 search of SENTENCES 20-token sources (the headline point) on THREADS threads, after its steady
state, CALLS times: each call's time, and (stderr, from a build with group_times.patch applied) the time of the
groups' region, where each thread searches its own group of sentences, with each group's start and end in it. The
rest of a call is the encoder, the cross-attention keys and values, and the Python around them.

    PYTHONPATH=<the patched build> python group_times.py THREADS SENTENCES CALLS
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding  # noqa: E402

threads, sentences, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
translate, src = cpu_decoding.steady_headline_search(threads, sentences, "int8")
os.environ["FASTFORMER_GROUP_TIMES"] = "1"
for _ in range(calls):
    start = time.perf_counter()
    translate(src)
    print(f"call {time.perf_counter() - start:.4f}", file=sys.stderr, flush=True)
