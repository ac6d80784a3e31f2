"""The beam-4 headline search (cpu_options.py's point: base model, 37k vocabulary, 64 sentences of 20 tokens, 31
target tokens each) in one process, under each setting in turn (which goes first alternating), ROUNDS rounds after
3 untimed calls of each -> each setting's median seconds and its time over the first setting's, round by round.

    OMP_NUM_THREADS=T PYTHONPATH=<a build with a switch> python switch_in_one_process.py T TYPE ROUNDS SETTING...

TYPE: int8 or float32. SETTING: VAR=VALUE[+VAR=VALUE...], set in the environment before each call (a trial patch's
switch, which its C++ reads at every call: split_prefetch_switch.patch's FF_SPLIT).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_options  # noqa: E402

threads, compute_type, rounds, settings = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
target_tokens = cpu_options.TARGET_TOKENS


def switch(setting: str) -> None:
    os.environ.update(kv.split("=", 1) for kv in setting.split("+"))


def search() -> float:
    start = time.perf_counter()
    model.translate(src, beam_size=4, max_len_a=1.0, max_len_b=target_tokens - 1 - src.shape[1],
                    min_len=model.config.max_positions, compute_type=compute_type, return_scores=True)
    return time.perf_counter() - start


for setting in settings:
    switch(setting)
    for _ in range(3):
        search()
seconds = {setting: [] for setting in settings}
for r in range(rounds):
    for setting in settings if r % 2 == 0 else settings[::-1]:
        switch(setting)
        seconds[setting].append(search())
for setting in settings:
    ratios = [a / b for a, b in zip(seconds[setting], seconds[settings[0]])]
    print(f"{setting}: median {statistics.median(seconds[setting]):.4f} s, min {min(seconds[setting]):.4f}; over "
          f"{settings[0]}: median {statistics.median(ratios):.4f} [{min(ratios):.4f}, {max(ratios):.4f}]", flush=True)
