"""python float32_calls.py CALLS THREADS: cpu_options.py's beam4 system in float32 (base model, 37k vocabulary, 64
sentences, THREADS threads), called once, then CALLS times; prints each call's seconds and tokens/s. Run under
`perf record` for the profiles here, with the package to profile first on PYTHONPATH."""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from cpu_options import fastformer_run, model_and_sources  # noqa: E402

threads = int(sys.argv[2])
model, src = model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
run = fastformer_run("beam4", model, src, "float32")
run()
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
    print(f"{seconds:.3f}s {tokens / seconds:.1f} tok/s", flush=True)
