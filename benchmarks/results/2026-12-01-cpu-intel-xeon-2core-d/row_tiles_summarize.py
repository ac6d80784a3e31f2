"""python row_tiles_summarize.py row_tiles_alternate.log: for each GEMM, row count and layer, the before / after time
ratio round by round (median and range): above 1, the change is faster."""

import re
import statistics
import sys
from collections import defaultdict

times = defaultdict(list)  # (gemm, rows, layer, which) -> [us per round]
which = gemm = None
for line in open(sys.argv[1]):
    header = re.match(r"== round \d+, (\w+), (.*)", line)
    if header:
        which, gemm = header.groups()
        continue
    row = re.match(r"rows (\d+): (.*)", line)
    if row:
        for item in row.group(2).split(", "):
            layer, us = item.rsplit(" ", 1)
            times[(gemm, int(row.group(1)), layer, which)].append(float(us))
for (gemm, rows, layer, which_one), before in sorted(times.items()):
    if which_one != "before":
        continue
    after = times[(gemm, rows, layer, "after")]
    ratios = sorted(b / a for b, a in zip(before, after))
    print(f"{gemm:46s} rows {rows:4d} {layer:12s} before/after median {statistics.median(ratios):.3f} "
          f"({ratios[0]:.3f}-{ratios[-1]:.3f})")
