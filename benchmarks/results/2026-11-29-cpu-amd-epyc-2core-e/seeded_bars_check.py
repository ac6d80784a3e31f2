"""seeded_bars.patch's summarize(seed_ids=...) against summarize without seeds, on the 37k output projection of
random base-model shapes (int8, one thread): the same values and ids at 1, 5, 32 and 64 rows and k 1, 10, 16, 17,
with seeds that are each row's top k + 3 shuffled (plus barred ids, -1 and repeats), random ids, or too few; then
the time of a summary alone and with seeds that are each row's own top k (the best a seed can do: the bar is the
k-th best from the first panel on), 40 calls of each in turn, medians.

    PYTHONPATH=<seeded_bars.patch's build> python seeded_bars_check.py
"""

import statistics
import time

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
torch.manual_seed(0)
OUT, IN, BARRED = 37000, 512, [0, 1]
linear = extension().PackedLinear(torch.randn(OUT, IN) * IN ** -0.5, torch.randn(OUT) * 0.1, 64, "int8")
print(f"route {linear.route}")
for rows in (1, 5, 32, 64):
    x = torch.randn(rows, IN)
    top = linear(x).topk(20, dim=1).indices
    for k in (1, 10, 16, 17):
        plain = linear.summarize(x, k, BARRED)
        mixed = torch.cat([top[:, torch.randperm(k + 3)], torch.tensor([[0, 1, -1]]).expand(rows, 3), top[:, :2]], 1)
        for seeds in (mixed, torch.randint(0, OUT, (rows, k)), top[:, :k - 1]):
            seeded = linear.summarize(x, k, BARRED, seed_ids=seeds.contiguous())
            assert torch.equal(seeded["values"], plain["values"]) and torch.equal(seeded["ids"], plain["ids"])
print("the same values and ids with and without seeds")
for rows in (32, 128):
    x = torch.randn(rows, IN)
    for k in (1, 10):
        seeds = linear.summarize(x, k, BARRED)["ids"].clone()
        times = {"alone": [], "seeded": []}
        for _ in range(40):
            for name, options in (("alone", {}), ("seeded", {"seed_ids": seeds})):
                start = time.perf_counter()
                linear.summarize(x, k, BARRED, **options)
                times[name].append(time.perf_counter() - start)
        alone, seeded = statistics.median(times["alone"]), statistics.median(times["seeded"])
        print(f"rows {rows:3d} k {k:2d}: alone {alone * 1e3:.3f} ms, seeded {seeded * 1e3:.3f} ms, "
              f"seeded / alone {seeded / alone:.3f}")
