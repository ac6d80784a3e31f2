"""ab/*.json -> per point: fastformer float32 before and after (each round, median), the change's median ratio, and
after against CTranslate2 float32 at its best in the same runs (median of the rounds' ratios)."""

import json
import statistics
from collections import defaultdict
from pathlib import Path

runs = defaultdict(dict)  # (threads, beam) -> {"before"/"after"/"ct2": [tok/s per round]}
for path in sorted((Path(__file__).parent / "ab").glob("*.json")):
    side = path.stem.split("-")[0]
    for row in json.loads(path.read_text())["rows"]:
        if row["status"] != "ok" or row["system"] not in ("fastformer-float32", "ctranslate2-float32"):
            continue
        point = (row["threads"], row["beam"])
        name = side if row["system"] == "fastformer-float32" else f"ct2-{row['threading']}-{path.stem}"
        runs[point].setdefault(name, []).append(row["tokens_per_s"])
print("| threads | beam | before (rounds) | after (rounds) | after / before | CTranslate2 at its best | after / CTranslate2 |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for (threads, beam), sides in sorted(runs.items()):
    before, after = sides["before"], sides["after"]
    # CTranslate2's best mode in each after-run, then the ratio round by round
    ct2 = [max(v[0] for k, v in sides.items() if k.startswith("ct2-") and k.endswith(f"after-{r}"))
           for r in range(1, len(after) + 1)]
    per_round = [a / c for a, c in zip(after, ct2)]
    fmt = lambda xs: ", ".join(f"{x:,.0f}" for x in xs)
    print(f"| {threads} | {beam} | {fmt(before)} | {fmt(after)} | {statistics.median(after) / statistics.median(before):.2f} "
          f"| {fmt(ct2)} | {statistics.median(per_round):.2f} ({min(per_round):.2f}-{max(per_round):.2f}) |")
