"""Translation of 1 and 4 sentences (20-token sources, 30 target tokens as cpu_decoding.py's points force) on the
base model with a 37k vocabulary, each shape after its steady state: the best and the median of 15 calls, in ms.

    PYTHONPATH=<a build's checkout> python one_sentence.py THREADS COMPUTE_TYPE
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding  # noqa: E402

from fastformer import Transformer  # noqa: E402

threads, compute_type = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(threads)
torch.manual_seed(0)
model = Transformer(cpu_decoding.shape_config("b", 37000)).eval()
rows = []
for sentences, beam in ((1, 1), (1, 4), (4, 4)):
    point = cpu_decoding.Point(threads, beam, 20, (sentences,))
    translate = cpu_decoding.fastformer_translator(model, compute_type, point)
    src = cpu_decoding.sources(model.config, sentences, 20, 0)
    cpu_decoding.steady_call(translate, src)
    seconds = []
    for _ in range(15):
        start = time.perf_counter()
        translate(src)
        seconds.append(time.perf_counter() - start)
    rows.append(f"{sentences} sent beam {beam}: best {min(seconds) * 1e3:.1f} ms median "
                f"{statistics.median(seconds) * 1e3:.1f}")
print(" | ".join(rows))
