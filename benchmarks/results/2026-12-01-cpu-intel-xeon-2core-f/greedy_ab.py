"""python greedy_ab.py BEFORE AFTER PAIRS THREADS SENTENCES: the packages at BEFORE and AFTER (PYTHONPATH) in turn,
PAIRS times, each in a process of its own capped to AVX2 + AVX-VNNI: int8 greedy search of the first SENTENCES of
cpu_options.py's 64 sentences (base model, 37k vocabulary, 31 target tokens each), its best of 5 calls after one, in
tokens/s; then the medians and the pairs' ratios, after over before."""
import os
import statistics
import subprocess
import sys
from pathlib import Path

before, after, pairs, threads, sentences = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
benchmarks = Path(__file__).resolve().parents[2]
code = r'''
import argparse, sys, time
sys.path.insert(0, sys.argv[3])
from cpu_options import fastformer_run, model_and_sources
model, src = model_and_sources(argparse.Namespace(threads=int(sys.argv[1]), seed=0, shape="b", vocab=37000))
run = fastformer_run("greedy", model, src[: int(sys.argv[2])], "int8")
run()
best = 0
for _ in range(5):
    t = time.perf_counter(); n = run(); s = time.perf_counter() - t
    best = max(best, n / s)
print(best)
'''
env = dict(os.environ, FASTFORMER_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS=threads)
speeds = {"before": [], "after": []}
for _ in range(pairs):
    for name, path in (("before", before), ("after", after)):
        out = subprocess.run([sys.executable, "-c", code, threads, sentences, str(benchmarks)],
                             env=dict(env, PYTHONPATH=path), cwd="/tmp", capture_output=True, text=True, check=True)
        speeds[name].append(float(out.stdout.split()[-1]))
        print(name, f"{speeds[name][-1]:.1f}", flush=True)
ratios = [a / b for b, a in zip(speeds["before"], speeds["after"])]
print(f"threads {threads}, {sentences} sentences: before {statistics.median(speeds['before']):.1f}, after "
      f"{statistics.median(speeds['after']):.1f} tok/s (medians), after / before median {statistics.median(ratios):.3f} "
      f"({min(ratios):.3f}-{max(ratios):.3f})")
