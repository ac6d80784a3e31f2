"""python groups_ab.py THREADS SYSTEM COMPUTE_TYPE SENTENCES PAIRS, with groups_trial.patch built in place and on
PYTHONPATH: cpu_options.py's SYSTEM (greedy, beam4, score) on its first SENTENCES sentences, one group of sentences
(the GEMMs split over the threads) against two (a group a thread) in turn in one process, PAIRS pairs (the order
swapped every pair): the medians in tokens/s and the pairs' ratios, one group over two."""
import argparse, os, sys, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from cpu_options import fastformer_run, model_and_sources
threads, system, ctype, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
model, src = model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
run = fastformer_run(system, model, src[:n], ctype)
res = {"1": [], "2": []}
for g in "12":
    os.environ["FASTFORMER_TRIAL_GROUPS"] = g; run(); run()
ratios = []
for i in range(int(sys.argv[5])):
    t = {}
    for g in ("12" if i % 2 == 0 else "21"):
        os.environ["FASTFORMER_TRIAL_GROUPS"] = g
        s = time.perf_counter(); tok = run(); t[g] = tok / (time.perf_counter() - s)
        res[g].append(t[g])
    ratios.append(t["1"] / t["2"])
print(f"{system} {ctype} {n} sentences {threads} threads: one group {statistics.median(res['1']):.0f}, two {statistics.median(res['2']):.0f} tok/s; one/two median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f})")
