"""benchmarks/throughput.py at an older commit and at this checkout, side by side on one machine: rounds that
alternate which goes first, each run a process of its own, and per system the ratio of the two in each round (so the
machine's drift cancels), for "no slower than before" checks.

    python benchmarks/ab_throughput.py --baseline 0097ec4 --rounds 3 --out-dir DIR -- \\
        --train --preset base --quick --systems fastformer,fastformer-captured

The baseline's source tree is a git worktree of that commit under --work-dir; a tree without its compiled extension
gets it built in place with this Python (`setup.py build_ext --inplace`), this checkout included. Each run uses its
own tree's throughput.py with the arguments after `--` (so they must exist at both commits), imports its own tree's
fastformer (PYTHONPATH), and writes its JSON under DIR; DIR/ab_throughput.json has every run and the ratios.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def baseline_tree(commit: str, work_dir: Path) -> Path:
    """-> a worktree of `commit` under work_dir, made if missing."""
    tree = work_dir / f"baseline-{git('rev-parse', '--short', commit)}"
    if not tree.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "--detach", "-f", str(tree), commit)
    return tree


def ensure_built(tree: Path) -> None:
    if not glob.glob(str(tree / "fastformer" / "_C*.so")):
        print(f"building the extension in {tree}", flush=True)
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, check=True,
                       stdout=subprocess.DEVNULL)


def run_throughput(tree: Path, arguments: list[str], out_dir: Path) -> dict:
    """-> {system: median tokens/s} of one throughput.py run of `tree`, for its training and inference rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "benchmarks" / "throughput.py"), *arguments, "--out-dir", str(out_dir)],
                   cwd=out_dir, env=env, check=True, stdout=subprocess.DEVNULL)
    results = json.loads((out_dir / "throughput.json").read_text())
    rates = {}
    for section in ("training", "inference"):
        for row in results.get(section, []):
            if row.get("status") == "ok":
                rates[f"{section} {row['preset']} {row['system']}"] = row["tokens_per_s"]["median"]
    return {"rates": rates, "environment": results.get("environment")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the older commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/fastformer-ab"))
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("throughput_args", nargs=argparse.REMAINDER, help="after --: throughput.py's arguments")
    args = parser.parse_args()
    arguments = [a for a in args.throughput_args if a != "--"]
    if "--out-dir" in arguments:
        parser.error("--out-dir is this script's: each run gets a folder under it")
    trees = {"baseline": baseline_tree(args.baseline, args.work_dir), "head": REPO}
    for tree in trees.values():
        ensure_built(tree)
    commits = {name: git("rev-parse", "HEAD", cwd=tree) for name, tree in trees.items()}
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    runs = []
    for round_index in range(args.rounds):
        order = ("baseline", "head") if round_index % 2 == 0 else ("head", "baseline")
        for name in order:
            run = run_throughput(trees[name], arguments, args.out_dir / f"round{round_index}-{name}")
            runs.append({"round": round_index, "tree": name, **run})
            print(f"round {round_index} {name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in run["rates"].items()),
                  flush=True)
    systems = sorted({key for run in runs for key in run["rates"]})
    summary = {}
    for system in systems:
        by_round = {(run["round"], run["tree"]): run["rates"].get(system) for run in runs}
        ratios = [by_round[(r, "head")] / by_round[(r, "baseline")] for r in range(args.rounds)
                  if by_round.get((r, "head")) and by_round.get((r, "baseline"))]
        summary[system] = {
            "baseline_median": statistics.median(v for (_, tree), v in by_round.items() if tree == "baseline" and v),
            "head_median": statistics.median(v for (_, tree), v in by_round.items() if tree == "head" and v),
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios) if ratios else None,
        }
        print(f"{system}: head / baseline per round {', '.join(f'{r:.3f}' for r in ratios)}; "
              f"median {summary[system]['ratio_median']:.3f}" if ratios else f"{system}: no pair")
    record = {"command": " ".join([sys.executable, *sys.argv]), "commits": commits, "head_dirty": dirty,
              "environment": runs[0]["environment"] if runs else None, "runs": runs, "summary": summary}
    (args.out_dir / "ab_throughput.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out_dir / 'ab_throughput.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
