"""The beam-4 search at cpu_options.py's point on THREADS threads, profiled: 3 searches after 4, perf record
attached to this process at 1000 Hz (GRAPH: perf's --call-graph mode, "" or none for none) -> seconds a search; the
data to OUT. COMPUTE_TYPE: int8 (the default) or float32.

    PYTHONPATH=<a build's checkout> python profile_beam4.py THREADS OUT [GRAPH [COMPUTE_TYPE]]
"""
import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402

threads, out = int(sys.argv[1]), sys.argv[2]
graph = sys.argv[3] if len(sys.argv) > 3 else ""
compute_type = sys.argv[4] if len(sys.argv) > 4 else "int8"
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
tt = cpu_options.TARGET_TOKENS


def run():
    model.translate(src, beam_size=4, max_len_a=1.0, max_len_b=tt - 1 - src.shape[1],
                    min_len=model.config.max_positions, compute_type=compute_type, return_scores=True)


for _ in range(4):
    run()
cmd = ["perf", "record", "-F", "1000", "-p", str(os.getpid()), "-o", out] + (["--call-graph", graph] if graph else [])
perf = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1)
t = time.perf_counter()
for _ in range(3):
    run()
print("s a search", (time.perf_counter() - t) / 3)
perf.send_signal(signal.SIGINT)
perf.wait()
