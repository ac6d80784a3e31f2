"""ab.sh's runs: per system and thread count, each pair's new/old tokens/s and the median over the pairs.

    python ab_summary.py OUT_DIR
"""
import argparse
import json
import statistics
from pathlib import Path


def rates(path: Path) -> dict[tuple[str, int], float]:
    rows = json.loads(path.read_text())["rows"]
    return {(row["system"], row["threads"]): row["tokens_per_s"] for row in rows if row["status"] == "ok"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    out_dir = parser.parse_args().out_dir
    pairs = sorted(int(p.stem.split("-")[1]) for p in out_dir.glob("old-*.json"))
    old = {pair: rates(out_dir / f"old-{pair}.json") for pair in pairs}
    new = {pair: rates(out_dir / f"new-{pair}.json") for pair in pairs}
    print(f"{'system':<20} {'threads':>7}  {'old tok/s (median)':>18}  {'new tok/s (median)':>18}  new/old per pair")
    for key in sorted(old[pairs[0]]):
        ratios = [new[pair][key] / old[pair][key] for pair in pairs]
        print(f"{key[0]:<20} {key[1]:>7}  {statistics.median(old[p][key] for p in pairs):>18.1f}  "
              f"{statistics.median(new[p][key] for p in pairs):>18.1f}  "
              f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
