"""One group of 32 sentences (beam 4, 20 source tokens, the base model with a 37k vocabulary) on one thread: its
GEMM floor (cpu_decoding.gemm_floor) or its whole search, timed 8 times from wall-clock time --start, so that two
processes started together on the two cores time theirs side by side (lockstep.sh). One JSON line.

    python lockstep.py floor float32 --start T
    python lockstep.py search int8 --start T

Run from outside the checkout, with the installed package; cpu_decoding.py is imported from the checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding as cd  # noqa: E402
from fastformer import Transformer  # noqa: E402

SENTENCES, BEAM, SOURCE_TOKENS = 32, 4, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("floor", "search"))
    parser.add_argument("compute_type", choices=("float32", "int8"))
    parser.add_argument("--start", type=float, required=True, help="the wall-clock time to start timing at")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(cd.shape_config("b", 37000)).eval()
    point = cd.Point(1, BEAM, SOURCE_TOKENS, (SENTENCES,))
    if args.part == "floor":
        call = cd.gemm_floor(model, args.compute_type, point, SENTENCES)
        call()
    else:
        translate = cd.fastformer_translator(model, args.compute_type, point)
        src = cd.sources(model.config, SENTENCES, SOURCE_TOKENS, 0)
        cd.steady_call(translate, src)

        def call() -> float:
            start = time.perf_counter()
            translate(src)
            return time.perf_counter() - start
    while time.time() < args.start:
        time.sleep(0.01)
    seconds = [round(call(), 4) for _ in range(8)]
    print(json.dumps({"part": args.part, "compute_type": args.compute_type, "seconds": seconds, "best": min(seconds),
                      "cpu": cd.cpu_description(), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
