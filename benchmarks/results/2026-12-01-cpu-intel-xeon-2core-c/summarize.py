"""python summarize.py alternate.log: each system's speed after / before, round by round (median and range)."""

import json
import statistics
import sys

runs = {"before": [], "after": []}
for line in open(sys.argv[1]):
    which, _, record = line.partition(" ")
    if which in runs:
        runs[which].append(json.loads(record))
for system in [key for key in runs["after"][0] if key != "package"]:
    ratios = sorted(b[system] / a[system] for b, a in zip(runs["before"], runs["after"]))
    print(f"{system}: ms before {[round(r[system] * 1e3) for r in runs['before']]}, after "
          f"{[round(r[system] * 1e3) for r in runs['after']]}; speed after / before, round by round: median "
          f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")
