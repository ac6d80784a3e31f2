"""benchmarks/throughput.py (or cpu_decoding.py) at an older commit and at this checkout, side by side on one
machine: rounds that alternate which goes first, each run a process of its own, and per system the ratio of the two
in each round (so the machine's drift cancels), for "no slower than before" checks.

    python benchmarks/ab_throughput.py --baseline 0097ec4 --rounds 3 --out-dir DIR -- \\
        --train --preset base --quick --systems fastformer,fastformer-captured
    python benchmarks/ab_throughput.py --benchmark cpu_decoding --baseline 0097ec4 --rounds 6 --out-dir DIR -- \\
        --systems fastformer-int8 --threads 1 2 --sentences 64 --beam 4 --rounds 1

cpu_decoding.py's rows are keyed by system, CTranslate2's mode (threading and ctranslate2_isa), threads, beam,
sentences and source tokens; its own `--rounds` are the rounds inside one run (1 suffices: the alternating runs are
the rounds here), and its `--cap-isa` caps both trees.

The baseline's source tree is a git worktree of that commit under --work-dir, or --baseline-tree where this checkout
has no git history (a copy on another machine: `git archive COMMIT | tar -x -C DIR` made it, and FASTFORMER_COMMIT
names this checkout's commit). When the runs translate (anything but `--train`), a tree without its compiled extension
gets it built in place with this Python (`setup.py build_ext --inplace`), this checkout included; training imports
no extension. Each run uses its own tree's benchmark script with the arguments after `--` (so they must exist at both
commits), imports its own tree's fastformer (PYTHONPATH), runs from its own folder under DIR (not from a checkout,
whose source tree would shadow the package) and writes its JSON and log there, the JSON naming its own tree's commit
(FASTFORMER_COMMIT, set per run); DIR/ab_throughput.json has every run and the ratios, rewritten after each run. A
run that writes no JSON (an argument its script refuses) ends the comparison, naming its log.
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

import bench_utils as bu

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


def run_benchmark(benchmark: str, tree: Path, commit: str, arguments: list[str], out_dir: Path) -> dict:
    """-> {"rates": {row: tokens/s}, "environment": ...} of one run of `tree`'s benchmarks/BENCHMARK.py, its JSON
    recording `commit` (FASTFORMER_COMMIT): for throughput.py its training and inference rows' medians, for
    cpu_decoding.py each row's median. A run that writes no JSON ends the script, naming its log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "FASTFORMER_COMMIT": commit}
    log_path, json_path = out_dir / f"{benchmark}.log", out_dir / f"{benchmark}.json"
    output = ["--out-dir", str(out_dir)] if benchmark == "throughput" else ["--out", str(json_path)]
    json_path.unlink(missing_ok=True)  # an earlier ab_throughput.py's JSON in the same folder must not pass for this
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, str(tree / "benchmarks" / f"{benchmark}.py"), *arguments, *output],
                              cwd=out_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    # throughput.py exits 1 when a row failed, after writing its JSON: the rows that ran still count.
    if not json_path.is_file():
        last = (log_path.read_text().strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"the run of {commit} ({tree}) failed with exit status {done.returncode}, writing no JSON: "
                         f"{last} (log: {log_path})")
    results = json.loads(json_path.read_text())
    rates = {}
    if benchmark == "cpu_decoding":
        for row in results["rows"]:
            if row.get("status") == "ok":
                # CTranslate2's mode as cpu_options.py names it (threading, then a forced ISA): its own pick and
                # its AVX-512 row are two rows; a row of a run before ctranslate2_isa was recorded is its own pick.
                isa = row.get("ctranslate2_isa", "its own pick")
                mode = row["threading"] + ("" if isa == "its own pick" else f" {isa}")
                point = f"threads={row['threads']} beam={row['beam']} sentences={row['sentences']}"
                rates[f"{row['system']} {mode} {point} source={row['source_tokens']}"] = row["tokens_per_s"]
        environment = {key: results.get(key)
                       for key in ("cpu", "isa_caps", "torch", "python", "commit", "fastformer_path", "date")}
        return {"rates": rates, "environment": environment}
    for section in ("training", "inference"):
        for row in results.get(section, []):
            if row.get("status") == "ok":
                rates[f"{section} {row['preset']} {row['system']}"] = row["tokens_per_s"]["median"]
    return {"rates": rates, "environment": results.get("environment")}


def summarize(runs: list[dict]) -> dict:
    """-> per system the medians of each tree and the head / baseline ratio of each round that has both."""
    summary = {}
    for system in sorted({key for run in runs for key in run["rates"]}):
        by_round = {(run["round"], run["tree"]): run["rates"].get(system) for run in runs}
        rounds = sorted({r for r, _ in by_round})
        ratios = [by_round[(r, "head")] / by_round[(r, "baseline")] for r in rounds
                  if by_round.get((r, "head")) and by_round.get((r, "baseline"))]
        medians = {tree: [v for (_, t), v in by_round.items() if t == tree and v] for tree in ("baseline", "head")}
        summary[system] = {
            "baseline_median": statistics.median(medians["baseline"]) if medians["baseline"] else None,
            "head_median": statistics.median(medians["head"]) if medians["head"] else None,
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios) if ratios else None,
        }
    return summary


def commit_of(tree: Path, named: str | None) -> str:
    """-> `named` where given, else the commit `tree` is checked out at. A named commit comes first: a tree copied
    into another checkout, or a copy carrying a stale .git, would report that checkout's commit."""
    if named:
        return named
    try:
        return git("rev-parse", "HEAD", cwd=tree)
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise SystemExit(f"{tree} is no git checkout: name its commit (--baseline-tree's is --baseline; "
                         "this checkout's is FASTFORMER_COMMIT)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark", choices=("throughput", "cpu_decoding"), default="throughput",
                        help="the script of benchmarks/ both trees run")
    parser.add_argument("--baseline", required=True, help="the older commit")
    parser.add_argument("--rounds", type=bu.positive_int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/fastformer-ab"))
    parser.add_argument("--baseline-tree", type=Path,
                        help="the baseline's source tree, made beforehand (instead of a worktree of --baseline)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("benchmark_args", nargs=argparse.REMAINDER, help="after --: the benchmark's arguments")
    args = parser.parse_args()
    arguments = [a for a in args.benchmark_args if a != "--"]
    if "--out-dir" in arguments or "--out" in arguments:
        parser.error("--out-dir and --out are this script's: each run gets a folder under it")
    script = Path("benchmarks") / f"{args.benchmark}.py"
    if args.baseline_tree is not None and not (args.baseline_tree / script).is_file():
        parser.error(f"--baseline-tree {args.baseline_tree} holds no {script}")
    if args.baseline_tree is None:
        try:
            git("rev-parse", "--verify", "--quiet", f"{args.baseline}^{{commit}}")
        except (subprocess.CalledProcessError, FileNotFoundError):
            parser.error(f"--baseline {args.baseline} is no commit of {REPO} (or give --baseline-tree)")
    baseline = args.baseline_tree or baseline_tree(args.baseline, args.work_dir)
    trees = {"baseline": baseline.resolve(), "head": REPO}
    if "--train" not in arguments:
        for tree in trees.values():
            ensure_built(tree)
    commits = {"baseline": commit_of(trees["baseline"], args.baseline if args.baseline_tree else None),
               "head": commit_of(REPO, os.environ.get("FASTFORMER_COMMIT"))}
    try:
        dirty: bool | None = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (subprocess.CalledProcessError, FileNotFoundError):
        dirty = None  # no git checkout: FASTFORMER_COMMIT's word is all there is
    # Each run's JSON names its own tree's commit (a run's own git would name the checkout it sits in, or none), the
    # head's with "+dirty" where its tree has uncommitted changes.
    run_commits = {"baseline": commits["baseline"], "head": commits["head"] + ("+dirty" if dirty else "")}
    runs: list[dict] = []
    record = {"command": " ".join([sys.executable, *sys.argv]), "commits": commits, "head_dirty": dirty,
              "environment": None, "runs": runs, "summary": {}}
    for round_index in range(args.rounds):
        order = ("baseline", "head") if round_index % 2 == 0 else ("head", "baseline")
        for name in order:
            run = run_benchmark(args.benchmark, trees[name], run_commits[name], arguments,
                                args.out_dir / f"round{round_index}-{name}")
            runs.append({"round": round_index, "tree": name, **run})
            print(f"round {round_index} {name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in run["rates"].items()),
                  flush=True)
            # Written after every run, so that a run cut short by a time limit keeps the rounds it finished.
            record.update(environment=runs[0]["environment"], summary=summarize(runs))
            (args.out_dir / "ab_throughput.json").write_text(json.dumps(record, indent=1))
    for system, row in record["summary"].items():
        ratios = row["ratio_per_round"]
        print(f"{system}: head / baseline per round {', '.join(f'{r:.3f}' for r in ratios)}; "
              f"median {row['ratio_median']:.3f}" if ratios else f"{system}: no pair")
    print(f"wrote {args.out_dir / 'ab_throughput.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
