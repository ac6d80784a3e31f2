"""One search repeated under perf: 64 sentences of 20 tokens, the base model with a 37k vocabulary, after its steady
state (cpu_decoding.steady_call); prints each timed call's seconds.

    perf record -F 499 -g -o perf.data python profile.py COMPUTE_TYPE THREADS BEAM CALLS
    perf report -i perf.data --no-children --sort symbol

Run from outside the checkout, with the installed package; cpu_decoding.py is imported from the checkout. The
samples also hold the process's set-up (the model's random weights, the conversion, the steady-state calls).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding as cd  # noqa: E402
from fastformer import Transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("compute_type", choices=("float32", "int8"))
    parser.add_argument("threads", type=int)
    parser.add_argument("beam", type=int)
    parser.add_argument("calls", type=int)
    args = parser.parse_args()
    compute_type, threads, beam, calls = args.compute_type, args.threads, args.beam, args.calls
    torch.manual_seed(0)
    model = Transformer(cd.shape_config("b", 37000)).eval()
    torch.set_num_threads(threads)
    translate = cd.fastformer_translator(model, compute_type, cd.Point(threads, beam, 20, (64,)))
    src = cd.sources(model.config, 64, 20, 0)
    cd.steady_call(translate, src)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        translate(src)
        seconds.append(round(time.perf_counter() - start, 3))
    print(seconds)


if __name__ == "__main__":
    main()
