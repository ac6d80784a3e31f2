"""One process: a cpu_options.py system (base model, 37k words, 64 sentences, int8, the threads of OMP_NUM_THREADS)
brought to steady state, then CALLS timed calls -> one JSON line (the system, the package's path, best and median
seconds). With --padded, the sources' lengths vary (12 to 31 tokens, the rest padding), as a batch's do; with
--sentences N, only the first N sentences are translated."""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

import torch  # noqa: E402

import cpu_options  # noqa: E402
from cpu_decoding import steady_call  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--system", required=True, help="greedy, beam4, score, ...")
parser.add_argument("--padded", action="store_true")
parser.add_argument("--sentences", type=int, help="only the first N sentences")
parser.add_argument("--calls", type=int, default=8)
parser.add_argument("--label", required=True)
args = parser.parse_args()
settings = argparse.Namespace(threads=torch.get_num_threads(), seed=0, shape="b", vocab=37000)
model, src = cpu_options.model_and_sources(settings)
if args.sentences:
    src = src[:args.sentences]
if args.padded:
    lengths = torch.randint(12, src.shape[1] + 1, (src.shape[0],), generator=torch.Generator().manual_seed(1))
    for row, length in enumerate(lengths.tolist()):
        src[row, length - 1] = model.config.eos_id
        src[row, length:] = model.config.pad_id
run = cpu_options.fastformer_run(args.system, model, src, "int8")
steady_call(lambda _: run(), src)
seconds = []
for _ in range(args.calls):
    start = time.perf_counter()
    run()
    seconds.append(time.perf_counter() - start)
import fastformer  # noqa: E402

print(json.dumps({"label": args.label, "system": args.system, "padded": args.padded, "sentences": len(src),
                  "package": str(Path(fastformer.__file__).parent), "best": min(seconds),
                  "median": statistics.median(seconds), "seconds": seconds}))
