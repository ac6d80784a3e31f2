"""cpu_options.py's fastformer systems (int8, the random base model with a 37k vocabulary, 64 sentences of 20 tokens,
31 target tokens each) on two threads, with the AMX tile before this change (FF_AMX_BEFORE=1, the switch of
amx_before_trial.patch) and after it, in turn in one process (which goes first alternating), ROUNDS rounds after 2
untimed calls each -> per system each one's median seconds and tokens/s, and after's time over before's, round by
round (median and range).

    OMP_NUM_THREADS=2 PYTHONPATH=<the trial build, built in place> python amx_in_turn.py ROUNDS SYSTEM...
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402

rounds, systems = int(sys.argv[1]), sys.argv[2:]
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=2, seed=0, shape="b", vocab=37000))


def timed(run, before: bool) -> tuple[float, int]:
    os.environ["FF_AMX_BEFORE"] = "1" if before else "0"
    start = time.perf_counter()
    tokens = run()
    return time.perf_counter() - start, tokens


for system in systems:
    run = cpu_options.fastformer_run(system, model, src, "int8")
    for _ in range(2):
        timed(run, True), timed(run, False)
    seconds = {True: [], False: []}
    for round_index in range(rounds):
        for before in (True, False) if round_index % 2 == 0 else (False, True):
            elapsed, tokens = timed(run, before)
            seconds[before].append(elapsed)
    ratios = [after / before for after, before in zip(seconds[False], seconds[True])]
    medians = {before: statistics.median(seconds[before]) for before in (True, False)}
    print(f"{system}: before {medians[True]:.4f} s ({tokens / medians[True]:.0f} tok/s), after {medians[False]:.4f} s "
          f"({tokens / medians[False]:.0f} tok/s); after / before, round by round: median "
          f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}", flush=True)
