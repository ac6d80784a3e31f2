"""What bounds the CPU search where issue 32's and 34's targets are still missed: the GEMMs' rates at the search's
shapes, the GEMM-floor shares of greedy and beam search, and the encoder's part of a call. One JSON line per part.

    python limits.py gemm                       # int8 linear layers, one thread, G multiply-adds/s
    python limits.py shares                     # share of the GEMM floor, beam 1 and 4, 1 and 2 threads
    python limits.py float32                    # float32 output projection against a layer (run capped: README)
    python limits.py floor --beam 4 --start T   # one group's GEMM floor, timed from wall-clock time T (lockstep.sh)

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
from fastformer.decoding import search  # noqa: E402
from fastformer.decoding.compiled import extension  # noqa: E402

D_MODEL, D_FF, VOCAB = 512, 2048, 37000
LAYER_SHAPES = [(3 * D_MODEL, D_MODEL), (D_MODEL, D_MODEL), (D_FF, D_MODEL), (D_MODEL, D_FF)]  # (out, in)


def gmacs(call, macs: int, seconds_per_pass: float = 0.3, passes: int = 5) -> float:
    """The best rate of `passes` timed passes of about seconds_per_pass each, in G multiply-adds a second."""
    call()
    start = time.perf_counter()
    call()
    calls = max(1, int(seconds_per_pass / max(time.perf_counter() - start, 1e-6)))
    best = 0.0
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = max(best, macs * calls / (time.perf_counter() - start) / 1e9)
    return round(best, 1)


def packed(out: int, inp: int, rows: int, compute_type: str):
    generator = torch.Generator().manual_seed(out * 7 + inp)
    weight = torch.randn(out, inp, generator=generator) * inp ** -0.5
    layer = extension().PackedLinear(weight, torch.zeros(out), rows, compute_type)
    return layer, torch.randn(rows, inp, generator=generator)


def gemm_part() -> dict:
    """int8 on one thread: the decoder's layers at a greedy group's 32 rows and the headline group's 128, the
    encoder's at 64 sentences of 21 tokens (1344 rows); the 2048-output layer's summary beside its GEMM at 1344 rows
    (the summary writes no outputs); the output projection's summary as greedy search (k=1) and beam 4 (k=8 with the
    log-softmax's terms) run it."""
    torch.set_num_threads(1)
    rates = {}
    for rows in (32, 128, 1344):
        for out, inp in LAYER_SHAPES:
            layer, x = packed(out, inp, rows, "int8")
            rates[f"{out}x{inp} rows {rows}"] = gmacs(lambda: layer(x), rows * out * inp)
    layer, x = packed(D_FF, D_MODEL, 1344, "int8")
    rates["2048x512 rows 1344 summary k=1"] = gmacs(lambda: layer.summarize(x, 1, [0, 1]), 1344 * D_FF * D_MODEL)
    for rows, k in ((32, 1), (128, 8)):
        layer, x = packed(VOCAB, D_MODEL, rows, "int8")
        eos = torch.full((rows,), 2, dtype=torch.int64)
        summary = ((lambda: layer.summarize(x, 1, [0, 1])) if k == 1 else
                   (lambda: layer.summarize(x, k, [0, 1], log_totals=True, picked_ids=eos)))
        rates[f"{VOCAB}x{D_MODEL} rows {rows} summary k={k}"] = gmacs(summary, rows * VOCAB * D_MODEL)
    return {"part": "gemm", "threads": 1, "int8_gmacs": rates}


def shares_part(seed: int = 0) -> dict:
    """At 64 sentences of 20 tokens, int8: the GEMM floor and the search beside it (cpu_decoding.share_of_gemm_floor)
    for greedy search and beam 4 on 1 and 2 threads, and the encoder's time beside a whole call."""
    torch.manual_seed(seed)
    model = Transformer(cd.shape_config("b", VOCAB)).eval()
    compiled = search.model_compiled(model, "int8")
    rows = []
    for beam in (1, 4):
        for threads in (1, 2):
            point = cd.Point(threads, beam, 20, (64,))
            floor, searched = cd.share_of_gemm_floor(model, "int8", point, 64, seed)
            src = cd.sources(model.config, 64, 20, seed)
            translate = cd.fastformer_translator(model, "int8", point)
            torch.set_num_threads(threads)
            encodes, calls = [], []
            with torch.no_grad():
                for _ in range(5):
                    start = time.perf_counter()
                    search.encode(model, src, compiled)
                    encodes.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    translate(src)
                    calls.append(time.perf_counter() - start)
            rows.append({"beam": beam, "threads": threads, "gemm_floor_s": round(floor, 4),
                         "search_s": round(searched, 4), "share_of_gemm_floor": round(floor / searched, 3),
                         "encoder_s": round(min(encodes), 4), "call_s": round(min(calls), 4),
                         "encoder_share_of_call": round(min(encodes) / min(calls), 3)})
    return {"part": "shares", "compute_type": "int8", "sentences": 64, "source_tokens": 20, "rows": rows}


def float32_part() -> dict:
    """float32 on one thread (oneDNN's packed GEMM, as the search runs it): the output projection at 32 and 128 rows,
    its 76 MB of weights streamed from memory each call, against the 2048-output layer (4 MB, in cache)."""
    torch.set_num_threads(1)
    rates = {}
    for out, rows in ((VOCAB, 32), (VOCAB, 128), (D_FF, 32), (D_FF, 128)):
        layer = extension().PackedLinear(torch.randn(out, D_MODEL) * D_MODEL ** -0.5, torch.zeros(out), rows,
                                         "float32", False)
        x = torch.randn(rows, D_MODEL)
        rates[f"{out}x{D_MODEL} rows {rows}"] = gmacs(lambda: layer(x), rows * out * D_MODEL)
    return {"part": "float32", "threads": 1, "float32_gmacs": rates}


def floor_part(beam: int, start_at: float) -> dict:
    """One group's GEMM floor (32 sentences, cpu_decoding.gemm_floor on one thread) timed 8 times from wall-clock
    time start_at, so that two processes started together time theirs side by side (lockstep.sh)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(cd.shape_config("b", VOCAB)).eval()
    floor = cd.gemm_floor(model, "int8", cd.Point(1, beam, 20, (32,)), 32)
    floor()
    while time.time() < start_at:
        time.sleep(0.01)
    seconds = [round(floor(), 4) for _ in range(8)]
    return {"part": "floor", "beam": beam, "seconds": seconds, "best": min(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("gemm", "shares", "float32", "floor"))
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--start", type=float, default=0.0, help="floor: the wall-clock time to start timing at")
    args = parser.parse_args()
    result = {"gemm": gemm_part, "shares": shares_part, "float32": float32_part,
              "floor": lambda: floor_part(args.beam, args.start)}[args.part]()
    print(json.dumps({**result, "cpu": cd.cpu_description(), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
