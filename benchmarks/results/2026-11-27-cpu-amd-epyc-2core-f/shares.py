"""The headline's share of the GEMM floor (64 sentences of 20 tokens, beam 4, the base model with a 37k vocabulary)
in one process, threads 2, 1, 2 in turn: cpu_decoding.share_of_gemm_floor, one JSON line each.

    python shares.py float32    # run capped to AVX2 for the own float32 GEMM (README)

Run from outside the checkout, with the installed package; cpu_decoding.py is imported from the checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding as cd  # noqa: E402
from fastformer import Transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("compute_type", choices=("float32", "int8"))
    compute_type = parser.parse_args().compute_type
    torch.manual_seed(0)
    model = Transformer(cd.shape_config("b", 37000)).eval()
    for threads in (2, 1, 2):
        floor, search = cd.share_of_gemm_floor(model, compute_type, cd.Point(threads, 4, 20, (64,)), 64, 0)
        print(json.dumps({"compute_type": compute_type, "threads": threads, "gemm_floor_s": round(floor, 4),
                          "search_s": round(search, 4), "share_of_gemm_floor": round(floor / search, 3),
                          "cpu": cd.cpu_description(), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
