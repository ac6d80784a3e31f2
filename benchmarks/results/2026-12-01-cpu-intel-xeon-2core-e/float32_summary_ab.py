"""python float32_summary_ab.py PAIRS THREADS BEAM: the package built in place at /tmp/base (the tree) and at /work/main
(the trial) in turn, PAIRS times, each in a process of its own capped to AVX2: float32 beam search of cpu_options.py's
64 sentences (base model, 37k vocabulary), its best of 3 calls after one, in tokens/s; then the medians and the pairs'
ratios, trial over tree."""
import subprocess, sys, statistics, os
pairs, threads, beam = int(sys.argv[1]), sys.argv[2], sys.argv[3]
code = r'''
import argparse, sys, time
sys.path.insert(0, "/work/main/benchmarks")
from cpu_options import fastformer_run, model_and_sources, BEAM
import cpu_options
cpu_options.BEAM = int(sys.argv[2])
threads = int(sys.argv[1])
model, src = model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
run = fastformer_run("beam4", model, src, "float32")
run()
best = 0
for _ in range(3):
    t = time.perf_counter(); n = run(); s = time.perf_counter() - t
    best = max(best, n / s)
print(best)
'''
env = dict(os.environ, FASTFORMER_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS=threads)
res = {"base": [], "new": []}
for _ in range(pairs):
    for name, path in (("base", "/tmp/base"), ("new", "/work/main")):
        out = subprocess.run([sys.executable, "-c", code, threads, beam], env=dict(env, PYTHONPATH=path),
                             capture_output=True, text=True, check=True).stdout
        res[name].append(float(out.split()[-1]))
        print(name, res[name][-1], flush=True)
ratios = [n / b for b, n in zip(res["base"], res["new"])]
print(f"threads {threads} beam {beam}: base {statistics.median(res['base']):.1f} new {statistics.median(res['new']):.1f} "
      f"tok/s, ratio median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
