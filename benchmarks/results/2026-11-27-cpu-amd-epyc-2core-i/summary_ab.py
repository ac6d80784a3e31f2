"""The int8 output projection's summary (37k x 512, 128 rows, k 8 with log-softmax terms and EOS), one thread, in
whichever tree PYTHONPATH names: best of 5 timings of 20 calls."""
import time, torch
from fastformer.decoding.compiled import extension
torch.set_num_threads(1)
ext = extension()
g = torch.Generator().manual_seed(0)
w = torch.randn(37000, 512, generator=g) * 0.05
b = torch.randn(37000, generator=g)
x = torch.randn(128, 512, generator=g)
lin = ext.PackedLinear(w, b, 128, "int8")
eos = torch.full((128,), 2, dtype=torch.int64)
for _ in range(3): lin.summarize(x, 8, [0, 1], log_totals=True, picked_ids=eos)
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    for _ in range(20): s = lin.summarize(x, 8, [0, 1], log_totals=True, picked_ids=eos)
    best = min(best, (time.perf_counter() - t) / 20)
print(f"{ext.cpu_isa()} {lin.route} summary {best*1e3:.2f} ms ids0 {s['ids'][0].tolist()} lt {s['log_totals'][:2].tolist()}")
