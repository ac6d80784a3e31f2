"""One of cpu_options.py's fastformer systems (greedy, sampling, beam4, ...) at its shape (int8, 64 sentences, 20-token
sources), called again and again in one process after its steady state: the best and the median of the calls.

    PYTHONPATH=<a build's checkout> python translate_calls.py SYSTEM THREADS CALLS
"""

import argparse
import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding  # noqa: E402
import cpu_options  # noqa: E402

system, threads, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
run = cpu_options.fastformer_run(system, model, src, "int8")
cpu_decoding.steady_call(lambda _: run(), src)
seconds = timeit.repeat(run, number=1, repeat=calls)
print(f"{system}, {threads} threads: best {min(seconds):.4f} s, median {statistics.median(seconds):.4f} s")
