"""cpu_options.py's greedy search and top-10 sampling (int8, 64 sentences of 20 tokens, 31 target tokens each, the
random base model) on one thread, profiled: each after 5 calls, 40 calls with `perf record` attached to this process
for them alone -> each one's mean time and its symbols with their sample counts. The perf data go to OUT_DIR.

    PYTHONPATH=<a build's checkout> python greedy_sampling_profile.py OUT_DIR
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

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=1, seed=0, shape="b", vocab=37000))
target_tokens = cpu_options.TARGET_TOKENS
CALLS = 40

for mode, options in (("greedy", {}), ("sampling", {"sampling_topk": cpu_options.TOP_K, "seed": 1})):
    def run() -> None:
        model.translate(src, beam_size=1, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                        min_len=model.config.max_positions, compute_type="int8", return_scores=False, **options)

    for _ in range(5):
        run()
    data = out_dir / f"{mode}.data"
    perf = subprocess.Popen(["perf", "record", "-F", "2000", "-p", str(os.getpid()), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # perf attached
    start = time.perf_counter()
    for _ in range(CALLS):
        run()
    seconds = (time.perf_counter() - start) / CALLS
    perf.send_signal(signal.SIGINT)
    perf.wait()
    print(f"{mode}, 1 thread: {seconds:.4f} s a search", flush=True)
    report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "symbol", "-n"],
                            capture_output=True, text=True).stdout
    samples = [" ".join(line.split())[:110] for line in report.splitlines() if line.strip()[:1].isdigit()]
    print("\n".join(samples[:12]), flush=True)
