"""What a vocabulary shortlist buys on the CPU: beam search with and without one, at cpu_decoding.py's points.

    python benchmarks/cpu_shortlist.py --rounds 5 --out runs/benchmarks/cpu_shortlist.json

The base model with a 37k vocabulary on random weights (cpu_decoding.py's), sources of 20 tokens plus EOS, every
hypothesis decoded to 31 target tokens, beam 4, int8 (--compute-type), at 1, 8 and 64 sentences on 1 and 2 threads.
The shortlist is random too, with `fastformer shortlist`'s defaults: 20 target ids per source id and the 100 ids
always kept, so a batch's vocabulary is the union of about 20 ids per source token (no overlap between source tokens,
which real shortlists have: a real one keeps fewer ids, and is faster). Each thread count runs in a process of its
own; in it, each batch size alternates the two searches over the rounds after both reach steady state
(cpu_decoding.py's rule), and a row reports the median. Beside each: the ids the batch keeps, and the weights a
decoding step reads, with and without the shortlist (the output projection's rows are most of them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import bench_utils as bu
from cpu_decoding import BYTES_PER_WEIGHT, Point, cpu_description, shape_config, sources, steady_call, \
    step_weight_bytes
from fastformer import Shortlist, Transformer

PER_SOURCE, ALWAYS = 20, 100
POINTS = [Point(threads, 4, 20, (1, 8, 64)) for threads in (1, 2)]


def random_shortlist(vocab: int, seed: int) -> Shortlist:
    generator = torch.Generator().manual_seed(seed)
    candidates = torch.randint(3, vocab, (vocab, PER_SOURCE), generator=generator)
    return Shortlist(candidates, torch.cat([torch.arange(3, 3 + ALWAYS), torch.tensor([2])]))


def run_worker(point: Point, args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(point.threads)
    torch.manual_seed(args.seed)
    config = shape_config(args.shape, args.vocab)
    model = Transformer(config).eval()
    shortlist = random_shortlist(config.vocab_size, args.seed)
    rows = []
    for n in point.sentences:
        src = sources(config, n, point.source_tokens, args.seed)

        def translate(src: torch.Tensor, with_shortlist: bool) -> list[list[int]]:
            results = model.translate(src, beam_size=point.beam, max_len_a=1.0,
                                      max_len_b=point.target_tokens - 1 - src.shape[1], min_len=config.max_positions,
                                      compute_type=args.compute_type, shortlist=shortlist if with_shortlist else None)
            return [sentence[0].tokens for sentence in results]

        warmup = {kept: steady_call(lambda s, kept=kept: translate(s, kept), src) for kept in (False, True)}
        seconds = {False: [], True: []}
        for _ in range(args.rounds):
            for kept in (False, True):
                start = time.perf_counter()
                translate(src, kept)
                seconds[kept].append(time.perf_counter() - start)
        kept_ids = len(shortlist.vocabulary(src, torch.full((n,), src.shape[1])))
        tokens = n * point.target_tokens
        full_bytes = step_weight_bytes(config, args.compute_type)
        short_bytes = full_bytes - (config.vocab_size - kept_ids) * config.d_model * BYTES_PER_WEIGHT[args.compute_type]
        for kept in (False, True):
            median = statistics.median(seconds[kept])
            rows.append({"threads": point.threads, "sentences": n, "beam": point.beam, "shortlist": kept,
                         "kept_ids": kept_ids if kept else config.vocab_size, "seconds": round(median, 4),
                         "tokens_per_s": round(tokens / median, 1),
                         "spread_tokens_per_s": [round(tokens / max(seconds[kept]), 1),
                                                 round(tokens / min(seconds[kept]), 1)],
                         "warmup_calls": warmup[kept],
                         "step_weight_bytes": short_bytes if kept else full_bytes})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("a", "b"), default="b", help="cpu_decoding.py's: a tiny, b base")
    parser.add_argument("--compute-type", choices=("float32", "int8"), default="int8")
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)  # one point's rows, for main
    args = parser.parse_args()
    if args.worker_threads:
        print(json.dumps(run_worker(next(p for p in POINTS if p.threads == args.worker_threads), args)))
        return 0
    rows = []
    for point in POINTS:
        command = [sys.executable, __file__, "--worker-threads", str(point.threads), "--shape", args.shape,
                   "--compute-type", args.compute_type, "--vocab", str(args.vocab), "--rounds", str(args.rounds),
                   "--seed", str(args.seed)]
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(point.threads)})
        if done.returncode != 0:
            sys.exit(f"the {point.threads}-thread worker failed: {done.stderr.strip().splitlines()[-1:]}")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    ratios = []
    for full, short in zip(rows[::2], rows[1::2]):
        ratio = short["tokens_per_s"] / full["tokens_per_s"]
        ratios.append({"threads": full["threads"], "sentences": full["sentences"], "kept_ids": short["kept_ids"],
                       "speedup": round(ratio, 3)})
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    for entry in ratios:
        print(json.dumps(entry))
    if args.out:
        payload = {"command": " ".join(["python", *sys.argv]), "cpu": cpu_description(),
                   "shape": args.shape, "compute_type": args.compute_type, "vocab": args.vocab, "rounds": args.rounds,
                   "per_source": PER_SOURCE, "always": ALWAYS, **bu.environment(torch.device("cpu")),
                   "rows": rows, "speedups": ratios}
        with open(args.out, "w") as handle:
            json.dump(payload, handle, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
