"""python greedy_side_by_side.py BEFORE AFTER ROUNDS SENTENCES: the packages at BEFORE and AFTER (PYTHONPATH) at the
same time, one thread each and one core each (taskset), the cores swapped every round, capped to AVX2 + AVX-VNNI:
int8 greedy search of the first SENTENCES of cpu_options.py's 64 sentences (base model, 37k vocabulary), 10 calls
each after two; per round the medians, and at the end the rounds' after / before ratios of the medians."""
import os
import statistics
import subprocess
import sys
from pathlib import Path

before, after, rounds, sentences = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
benchmarks = Path(__file__).resolve().parents[2]
code = r'''
import argparse, sys, time
sys.path.insert(0, sys.argv[2])
from cpu_options import fastformer_run, model_and_sources
model, src = model_and_sources(argparse.Namespace(threads=1, seed=0, shape="b", vocab=37000))
run = fastformer_run("greedy", model, src[: int(sys.argv[1])], "int8")
run(); run()
for _ in range(10):
    t = time.perf_counter(); n = run(); print(n / (time.perf_counter() - t), flush=True)
'''
env = dict(os.environ, FASTFORMER_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS="1")
ratios = []
for round_ in range(rounds):
    cores = {"before": str(round_ % 2), "after": str(1 - round_ % 2)}
    procs = {name: subprocess.Popen(["taskset", "-c", cores[name], sys.executable, "-c", code, sentences,
                                     str(benchmarks)], env=dict(env, PYTHONPATH=path), cwd="/tmp",
                                    stdout=subprocess.PIPE, text=True)
             for name, path in (("before", before), ("after", after))}
    medians = {name: statistics.median(float(line) for line in proc.communicate()[0].split())
               for name, proc in procs.items()}
    ratios.append(medians["after"] / medians["before"])
    print(f"round {round_ + 1}: before {medians['before']:.1f} tok/s on core {cores['before']}, after "
          f"{medians['after']:.1f} on core {cores['after']}: {ratios[-1]:.3f}", flush=True)
print(f"{sentences} sentences, one thread each: after / before median {statistics.median(ratios):.3f} "
      f"({min(ratios):.3f}-{max(ratios):.3f}) over {rounds} rounds")
