"""The int8 GEMM's next-block prefetch with the NTA hint against T1, in one process (a trial build's switch):
greedy search, beam 4, top-10 sampling, 64 sentences, int8, on `threads` threads, calls in turn -> per round the
ratio T1 seconds / NTA seconds (> 1: NTA faster)."""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import bench_utils as bu  # noqa: E402
import cpu_options  # noqa: E402
import fastformer._C as ext  # noqa: E402

threads, rounds = int(sys.argv[1]), int(sys.argv[2])
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
target_tokens = cpu_options.TARGET_TOKENS


def search(beam, nta, **options):
    def run():
        ext.trial_nta(nta)
        model.translate(src, beam_size=beam, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                        min_len=model.config.max_positions, compute_type="int8", return_scores=beam > 1, **options)
    return run


runs = {}
for name, beam, options in (("greedy", 1, {}), ("beam4", 4, {}), ("sampling", 1, {"sampling_topk": 10, "seed": 1})):
    for nta in (False, True):
        runs[f"{name} {'nta' if nta else 't1'}"] = search(beam, nta, **options)
for run in runs.values():
    for _ in range(3):
        run()
seconds = bu.calls_in_turn(runs, rounds)
for name in ("greedy", "beam4", "sampling"):
    ratios = [a / b for a, b in zip(seconds[f"{name} t1"], seconds[f"{name} nta"])]
    print(f"{threads} threads, {name}: t1 median {statistics.median(seconds[name + ' t1']):.4f} s, nta "
          f"{statistics.median(seconds[name + ' nta']):.4f} s; t1/nta per round median {statistics.median(ratios):.3f}"
          f" ({min(ratios):.3f}-{max(ratios):.3f}), nta faster in {sum(r > 1 for r in ratios)} of {len(ratios)}",
          flush=True)
