"""What a vocabulary shortlist buys on the CPU: beam search with and without one, at cpu_decoding.py's points, in
fastformer and in CTranslate2 (its `use_vmap`, given the same shortlist as its vmap.txt).

    python benchmarks/cpu_shortlist.py --rounds 5 --out runs/benchmarks/cpu_shortlist.json

The base model with a 37k vocabulary on random weights (cpu_decoding.py's), sources of 20 tokens plus EOS, every
hypothesis decoded to 31 target tokens, beam 4, int8 (--compute-type), at 1, 8 and 64 sentences on 1 and 2 threads.
The shortlist is random too, with `fastformer shortlist`'s defaults: 20 target ids per source id and the 100 ids
always kept, so a batch's vocabulary is the union of about 20 ids per source token (no overlap between source tokens,
which real shortlists have: a real one keeps fewer ids, and is faster). Each thread count runs in a process of its
own; in it, each batch size alternates the two searches over the rounds after both reach steady state
(cpu_decoding.py's rule), and a row reports the median. Beside each: the ids the batch keeps, and the weights a
decoding step reads, with and without the shortlist (the output projection's rows are most of them). Where
CTranslate2 is installed, the same for it (int8 or float32 as --compute-type) in a process of its own per thread
count and threading mode (intra-op threads; at 2 threads also `inter_threads=2` with max_batch_size = ceil(N / 2)),
the shortlist written as its vocabulary map (each source piece, a tab, its candidates; the always-kept pieces on the
line of the empty source) and turned on with `use_vmap`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import bench_utils as bu
from baselines import Ctranslate2Mode
from cpu_decoding import BYTES_PER_WEIGHT, Point, ctranslate2_translator, fastformer_translator, shape_config, \
    sources, steady_call, step_weight_bytes
from cpu_info import cpu_description
from fastformer import Shortlist, Transformer

PER_SOURCE, ALWAYS = 20, 100
MIN_VOCAB = 3 + ALWAYS  # the always-kept ids are 3 to 3 + ALWAYS - 1 (random_shortlist)
POINTS = [Point(threads, 4, 20, (1, 8, 64)) for threads in (1, 2)]


def random_shortlist(vocab: int, seed: int) -> Shortlist:
    generator = torch.Generator().manual_seed(seed)
    candidates = torch.randint(3, vocab, (vocab, PER_SOURCE), generator=generator)
    return Shortlist(candidates, torch.cat([torch.arange(3, 3 + ALWAYS), torch.tensor([2])]))


def run_worker(point: Point, system: str, args: argparse.Namespace) -> list[dict]:
    """Times `system` ("fastformer", "ctranslate2 intra" or "ctranslate2 inter") at every batch size of `point`."""
    torch.set_num_threads(point.threads)
    torch.manual_seed(args.seed)
    config = shape_config(args.shape, args.vocab)
    model = Transformer(config).eval()
    shortlist = random_shortlist(config.vocab_size, args.seed)
    translate = (fastformer_translator(model, args.compute_type, point, shortlist) if system == "fastformer"
                 else ctranslate2_translator(model, args.compute_type, system.split()[1], point, shortlist))
    rows = []
    for n in point.sentences:
        src = sources(config, n, point.source_tokens, args.seed)
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
        settings = {} if system == "fastformer" else Ctranslate2Mode(system.split()[1]).settings(point.threads, n)
        for kept in (False, True):
            median = statistics.median(seconds[kept])
            rows.append({"system": system, "threads": point.threads, "sentences": n, "beam": point.beam,
                         "shortlist": kept,
                         "kept_ids": kept_ids if kept else config.vocab_size, "seconds": round(median, 6),
                         "tokens_per_s": round(tokens / median, 1),
                         "spread_tokens_per_s": [round(tokens / max(seconds[kept]), 1),
                                                 round(tokens / min(seconds[kept]), 1)],
                         "warmup_calls": warmup[kept],
                         "step_weight_bytes": short_bytes if kept else full_bytes, **settings})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("a", "b"), default="b", help="cpu_decoding.py's: a tiny, b base")
    parser.add_argument("--compute-type", choices=("float32", "int8"), default="int8")
    parser.add_argument("--vocab", type=bu.int_at_least(MIN_VOCAB, f"the shortlist always keeps ids 3-{MIN_VOCAB - 1}"),
                        default=37000)
    parser.add_argument("--rounds", type=bu.positive_int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # THREADS SYSTEM: one worker's rows, for main
    args = parser.parse_args()
    if args.out and not args.worker:
        bu.check_output(parser, "--out", args.out)
    if args.worker:
        threads, system = int(args.worker[0]), args.worker[1]
        print(json.dumps(run_worker(next(p for p in POINTS if p.threads == threads), system, args)))
        return 0
    systems = ["fastformer"]
    if importlib.util.find_spec("ctranslate2") is not None:
        systems += ["ctranslate2 intra", "ctranslate2 inter"]
    rows = []
    for point in POINTS:
        for system in systems:
            if system == "ctranslate2 inter" and point.threads == 1:
                continue  # one thread: one mode
            command = [sys.executable, __file__, "--worker", str(point.threads), system, "--shape", args.shape,
                       "--compute-type", args.compute_type, "--vocab", str(args.vocab), "--rounds",
                       str(args.rounds), "--seed", str(args.seed)]
            # CTranslate2 at its own pick of ISA: one exported in the shell would run it at another.
            parent = (os.environ if system == "fastformer"
                      else Ctranslate2Mode(system.split()[1]).environment(os.environ))
            done = subprocess.run(command, capture_output=True, text=True,
                                  env={**parent, "OMP_NUM_THREADS": str(point.threads)})
            if done.returncode != 0:
                sys.exit(f"the {system} worker on {point.threads} threads failed: "
                         f"{done.stderr.strip().splitlines()[-1:]}")
            rows += json.loads(done.stdout.strip().splitlines()[-1])
    ratios = []
    for full, short in zip(rows[::2], rows[1::2]):
        ratio = short["tokens_per_s"] / full["tokens_per_s"]
        ratios.append({"system": full["system"], "threads": full["threads"], "sentences": full["sentences"],
                       "kept_ids": short["kept_ids"], "speedup": round(ratio, 3)})
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    for entry in ratios:
        print(json.dumps(entry))
    if args.out:
        payload = {"command": bu.command_line(sys.argv), "cpu": cpu_description(),
                   "ctranslate2": bu.ctranslate2_version(),
                   "shape": args.shape, "compute_type": args.compute_type, "vocab": args.vocab, "rounds": args.rounds,
                   "per_source": PER_SOURCE, "always": ALWAYS, **bu.environment(torch.device("cpu")),
                   "rows": rows, "speedups": ratios}
        bu.write_json(args.out, payload)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
