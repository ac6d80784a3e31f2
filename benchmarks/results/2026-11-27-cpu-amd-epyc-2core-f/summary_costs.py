"""What the int8 output projection's summary costs beside its GEMM (37k outputs, 512 inputs, one thread): each row's
best k outputs (k 0, 1, 8, 10: nothing, greedy search, beam 4's candidates, sampling's top-k) without and with the
log-softmax's terms (log_totals and the picked output, as beam search and scoring take them), in G multiply-adds a
second, the best of 5 passes of ~0.3 s; two repetitions. One JSON line per row count.

    python summary_costs.py

Run from outside the checkout, with the installed package, on a CPU where the int8 GEMM runs (VNNI).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-cpu-amd-epyc-2core-b"))
import cpu_decoding as cd  # noqa: E402
from fastformer.decoding.compiled import extension  # noqa: E402
from limits import gmacs  # noqa: E402  (the best of 5 passes of ~0.3 s, in G multiply-adds a second)

VOCAB, D_MODEL = 37000, 512


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, D_MODEL, generator=generator) * D_MODEL ** -0.5
    for rows in (32, 128):
        layer = extension().PackedLinear(weight, torch.zeros(VOCAB), rows, "int8")
        x = torch.randn(rows, D_MODEL, generator=generator)
        eos = torch.full((rows,), 2, dtype=torch.int64)
        macs = rows * VOCAB * D_MODEL
        rates = {"logits written": [], **{f"k={k}": [] for k in (0, 1, 8, 10)},
                 **{f"k={k} log_totals": [] for k in (0, 1, 8, 10)}}
        for _ in range(2):
            rates["logits written"].append(gmacs(lambda: layer(x), macs))
            for k in (0, 1, 8, 10):
                rates[f"k={k}"].append(gmacs(lambda: layer.summarize(x, k, [0, 1]), macs))
                rates[f"k={k} log_totals"].append(
                    gmacs(lambda: layer.summarize(x, k, [0, 1], log_totals=True, picked_ids=eos), macs))
        print(json.dumps({"rows": rows, "int8_gmacs": rates, "cpu": cd.cpu_description(),
                          "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
