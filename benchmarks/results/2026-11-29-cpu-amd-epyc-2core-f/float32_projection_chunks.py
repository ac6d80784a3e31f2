"""The float32 output projection (37000 x 512) at 128 and 256 rows: one call writing all logits, against chunks of
C outputs whose logits are reused (L2-resident), each followed by a scan (torch.max) -> seconds per projection."""
import time
import torch
import fastformer._C as ext

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
vocab, d = 37000, 512
w = torch.randn(vocab, d, generator=g) * d ** -0.5
full = ext.PackedLinear(w, torch.zeros(vocab), 256, "float32", True)
print("route", full.route)
chunks = {}
for c in (1024, 2048, 4096):
    chunks[c] = [ext.PackedLinear(w[i:i + c].contiguous(), torch.zeros(min(c, vocab - i)), 256, "float32", True)
                 for i in range(0, vocab, c)]


def best(f, n=7):
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter(); f(); times.append(time.perf_counter() - t)
    return min(times)


for rows in (128, 256):
    x = torch.randn(rows, d, generator=g)
    for rnd in range(2):
        t_full = best(lambda: full(x))
        t_full_scan = best(lambda: full(x).max(1))
        line = f"rows {rows}: full {t_full*1e3:.2f} ms, +max {t_full_scan*1e3:.2f}"
        for c, parts in chunks.items():
            t_c = best(lambda: [p(x) for p in parts])
            t_cs = best(lambda: [p(x).max(1) for p in parts])
            line += f" | C={c}: {t_c*1e3:.2f}, +max {t_cs*1e3:.2f}"
        print(line, flush=True)
