"""ab.sh's JSON -> the table of README.md: per round and side, the int8 GEMM rates at 1344 and 128 rows and the calls'
best seconds; then each figure's median over the rounds.  python ab_table.py [DIR]"""

import json
import statistics
import sys
from pathlib import Path

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
GEMMS = ["2048x512 rows 1344", "512x2048 rows 1344", "1536x512 rows 1344", "2048x512 rows 128", "37000x512 rows 32 summary k=1"]
CALLS = ["score", "greedy", "beam4"]
rows = {}
for side in ("before", "after"):
    for gemm_file in sorted(folder.glob(f"ab-{side}-*-gemm.json")):
        round_index = gemm_file.name.split("-")[2]
        gemm = json.loads(gemm_file.read_text())["int8_gmacs"]
        calls = json.loads((folder / f"ab-{side}-{round_index}-calls.json").read_text())["seconds"]
        rows.setdefault(side, []).append([gemm[g] for g in GEMMS] + [calls[c]["best"] for c in CALLS])
header = GEMMS + [f"{c} best s" for c in CALLS]
print("| side | round | " + " | ".join(header) + " |")
print("| --- | --- | " + " | ".join("---" for _ in header) + " |")
for side, values in rows.items():
    for index, row in enumerate(values, 1):
        print(f"| {side} | {index} | " + " | ".join(f"{v:g}" for v in row) + " |")
for side, values in rows.items():
    print(f"| {side} | median | " + " | ".join(f"{statistics.median(col):g}" for col in zip(*values)) + " |")
