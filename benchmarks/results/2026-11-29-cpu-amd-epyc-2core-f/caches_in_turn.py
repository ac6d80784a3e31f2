"""int8 search at cpu_options.py's point (the random base model, 37k vocabulary, 64 sentences of 20 tokens, 31
target tokens each) with the self-attention caches in bfloat16 against float16 (a trial build's FF_TRIAL_F16
switch), in one process on THREADS threads, calls in turn (order rotated a place a round) -> per system and round
the ratio float16 seconds / bfloat16 seconds (> 1: bfloat16 faster), median and range."""
import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import bench_utils as bu  # noqa: E402
import cpu_options  # noqa: E402

threads, rounds = int(sys.argv[1]), int(sys.argv[2])
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
target_tokens = cpu_options.TARGET_TOKENS


def search(beam, float16):
    def run():
        if float16:
            os.environ["FF_TRIAL_F16"] = "1"
        else:
            os.environ.pop("FF_TRIAL_F16", None)
        model.translate(src, beam_size=beam, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                        min_len=model.config.max_positions, compute_type="int8", return_scores=beam > 1)
    return run


runs = {f"{name} {cache}": search(beam, cache == "float16")
        for name, beam in (("greedy", 1), ("beam4", 4)) for cache in ("float16", "bfloat16")}
for run in runs.values():
    for _ in range(3):
        run()
seconds = bu.calls_in_turn(runs, rounds)
for name in ("greedy", "beam4"):
    ratios = [a / b for a, b in zip(seconds[f"{name} float16"], seconds[f"{name} bfloat16"])]
    print(f"{threads} thread(s), {name}: float16 median {statistics.median(seconds[name + ' float16']):.4f} s, "
          f"bfloat16 {statistics.median(seconds[name + ' bfloat16']):.4f} s; float16/bfloat16 per round median "
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), bfloat16 faster in "
          f"{sum(r > 1 for r in ratios)} of {len(ratios)}", flush=True)
