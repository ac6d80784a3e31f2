"""python score_chunks_ab.py THREADS COMPUTE_TYPE SENTENCES PAIRS, with score_chunks_toggle.patch built in place and
on PYTHONPATH: cpu_options.py's scoring of its first SENTENCES sentences (30 random target tokens and EOS each),
the output projection's summary in chunks of logits_rows_per_block rows (FASTFORMER_TRIAL_CHUNKS set, as before)
against up to scoring_summary_rows() rows a call, in turn in one process, PAIRS pairs (the order swapped every pair):
the medians in tokens/s and the pairs' ratios, one call over chunks."""
import argparse, os, sys, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from cpu_options import fastformer_run, model_and_sources
threads, ctype, n, pairs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model, src = model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
run = fastformer_run("score", model, src[:n], ctype)
def variant(v):
    if v == "chunks": os.environ["FASTFORMER_TRIAL_CHUNKS"] = "1"
    else: os.environ.pop("FASTFORMER_TRIAL_CHUNKS", None)
for v in ("chunks", "one"): variant(v); run(); run()
res = {"chunks": [], "one": []}; ratios = []
for i in range(pairs):
    t = {}
    for v in (("chunks", "one") if i % 2 == 0 else ("one", "chunks")):
        variant(v); s = time.perf_counter(); tok = run(); t[v] = tok / (time.perf_counter() - s); res[v].append(t[v])
    ratios.append(t["one"] / t["chunks"])
q = statistics.quantiles(ratios, n=4)
print(f"score {ctype} {n} sentences {threads} threads: chunks {statistics.median(res['chunks']):.0f}, one call {statistics.median(res['one']):.0f} tok/s; one/chunks median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, {min(ratios):.3f}-{max(ratios):.3f})")
