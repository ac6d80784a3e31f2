"""The A/B table of README.md from this folder's base-N.json (8c9bec4) and new-N.json (1249434)."""
import json, os, statistics
HERE = os.path.dirname(os.path.abspath(__file__))
print("| round | order | system | 8c9bec4 (libstdc++.so) tok/s | 1249434 (linked in) tok/s |")
print("| --- | --- | --- | --- | --- |")
meds = {}
for r in range(1, 12):
    order = "8c9bec4 first" if r in (1, 2, 3, 5, 7) else "1249434 first"
    for system in ("fastformer-int8", "fastformer-float32"):
        vals = []
        for side in ("base", "new"):
            d = json.load(open(os.path.join(HERE, f"{side}-{r}.json")))
            v = [row["tokens_per_s"] for row in d["rows"] if row.get("system") == system]
            vals.append(v[0] if v else None)
        if vals[0] is None: continue
        meds.setdefault(system, ([], []))
        meds[system][0].append(vals[0]); meds[system][1].append(vals[1])
        print(f"| {r} | {order} | {system} | {vals[0]:,.0f} | {vals[1]:,.0f} |")
for system, (a, b) in meds.items():
    print(f"| median of {len(a)} | | {system} | {statistics.median(a):,.0f} | {statistics.median(b):,.0f} |")
