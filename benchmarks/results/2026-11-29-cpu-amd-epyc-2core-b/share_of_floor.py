"""The int8 beam-4 search of 20-token sources (64 sentences: the headline shape) beside its GEMM floor, in one
process, as cpu_decoding.py's rows take them (share_of_gemm_floor: the floor and the search in turn, the best of
each).

    python share_of_floor.py THREADS [PAIRS] [SENTENCES]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding  # noqa: E402

from fastformer import Transformer  # noqa: E402

threads = int(sys.argv[1])
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
sentences = int(sys.argv[3]) if len(sys.argv) > 3 else 64
torch.set_num_threads(threads)
torch.manual_seed(0)
model = Transformer(cpu_decoding.shape_config("b", 37000)).eval()
point = cpu_decoding.Point(threads, 4, 20, (sentences,))
floor, search = cpu_decoding.share_of_gemm_floor(model, "int8", point, sentences, 0, pairs)
print(f"threads={threads} sentences={sentences} floor={floor:.4f} s search={search:.4f} s share={floor / search:.3f}")
