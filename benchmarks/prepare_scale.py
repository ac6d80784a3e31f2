"""Start-up at WMT14 size: time to the first update and machine-wide peak memory of `fastformer train` under torchrun,
with the corpus prepared in the run, already prepared, and on --resume.

Writes a synthetic WMT-like corpus (benchmarks/synthetic_wmt.py: N pairs, ~21 words a side) unless --data-dir holds
one, then runs, each under `torchrun --nproc_per_node=R` with the tiny preset and the paper's 37k vocabulary:
  first   2 ranks, a fresh prepared directory: preparation included, 1 update;
  second  2 ranks, a new out-dir on the same prepared directory, 1 update;
  resume  2 ranks, --resume of `first` to 2 updates;
  ranks4  4 ranks, a new out-dir on the same prepared directory, 1 update: per-rank memory against the number of
          ranks.
Every invocation starts afresh (it deletes the prepared directory and the runs' out-dirs), so --runs must name first
before second, resume or ranks4, which run on what first makes.
Time to the first update is when rank 0's first log line (--log-every 1) appears, from the launch. Micro-batches are
small (1024 tokens) so that the step's own memory (the 37k-vocabulary logits, on the CPU) stays small beside the
corpus's. Memory is sampled every 0.2 s from /proc over the launcher's process
tree: the sum of RSS (which counts a page mapped by several processes once per process) and the sum of PSS (which
shares it among them: the machine-wide figure), and each rank's own peak RSS.

    python benchmarks/prepare_scale.py --pairs 200000      # the full-size run: --pairs 4500000 on a quiet machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu  # noqa: E402
from cpu_info import cpu_slug  # noqa: E402
from synthetic_wmt import write_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUNS = ("first", "second", "resume", "ranks4")  # the module docstring's runs, in order
# What rank 0 prints after an update with --log-every 1 (the first one a run makes, a fresh or a resumed run).
FIRST_UPDATE_LINE = b"| loss "


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        todo += _children(current)
    return pids


def _memory_kib(pid: int) -> tuple[int, int]:
    """-> (RSS, PSS) of a process in KiB; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            fields = dict(line.split(":")[0:2] for line in file if line.startswith(("Rss:", "Pss:")))
        return int(fields["Rss"].split()[0]), int(fields["Pss"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0, 0


def measured_run(command: list[str], log: Path) -> dict:
    """Runs command, sampling its process tree's memory -> wall seconds, return code, peaks (GiB)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        peak_rss = peak_pss = 0
        per_process: dict[int, int] = {}
        first_update = None
        while process.poll() is None:
            if first_update is None and FIRST_UPDATE_LINE in log.read_bytes():
                first_update = time.perf_counter() - start
            total_rss = total_pss = 0
            for pid in _tree(process.pid):
                rss, pss = _memory_kib(pid)
                total_rss, total_pss = total_rss + rss, total_pss + pss
                per_process[pid] = max(per_process.get(pid, 0), rss)
            peak_rss, peak_pss = max(peak_rss, total_rss), max(peak_pss, total_pss)
            time.sleep(0.2)
    seconds = time.perf_counter() - start
    ranks = sorted(per_process.values(), reverse=True)
    return {"command": " ".join(command), "returncode": process.returncode, "seconds": round(seconds, 1),
            "first_update_s": None if first_update is None else round(first_update, 1),
            "peak_rss_sum_gib": round(peak_rss / 2 ** 20, 2), "peak_pss_sum_gib": round(peak_pss / 2 ** 20, 2),
            "largest_process_peak_rss_gib": [round(kib / 2 ** 20, 2) for kib in ranks[:4]], "log": str(log)}


def run_names(text: str) -> list[str]:
    """argparse type of --runs: comma-separated names of RUNS."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in RUNS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {','.join(RUNS)}, not {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=bu.positive_int, default=4_500_000)
    parser.add_argument("--work-dir", default="runs/prepare_scale", help="corpus, prepared corpus and runs")
    parser.add_argument("--data-dir", help="an existing corpus (default: write one of --pairs pairs)")
    parser.add_argument("--gz", action="store_true", help="write the corpus gzipped")
    parser.add_argument("--runs", type=run_names, default=list(RUNS),
                        help=f"comma-separated, of {','.join(RUNS)} (default: all); every invocation starts "
                        "afresh, so first must come before second, resume and ranks4, which run on what it makes")
    parser.add_argument("--out", type=Path, help="result JSON (default: benchmarks/results/<date>-cpu-<name>-<n>core/"
                        "prepare_scale.json, or -b, -c, ... after that folder where it exists)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.runs[0] != "first":
        parser.error(f"--runs {','.join(args.runs)} needs first before the others: every invocation starts afresh, "
                     "and second, resume and ranks4 run on the prepared directory (resume: the run) first makes")
    out = args.out or bu.first_free(REPO / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-"
                                    f"{cpu_slug()}") / "prepare_scale.json"
    bu.check_output(parser, "--out", out)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else work / f"corpus-{args.pairs}"
    generation = None
    if not args.data_dir and not (data_dir / "train.en").exists() and not (data_dir / "train.en.gz").exists():
        start = time.perf_counter()
        write_corpus(data_dir, args.pairs, gz=args.gz)
        generation = round(time.perf_counter() - start, 1)
    prepared_dir = work / "prepared"
    shutil.rmtree(prepared_dir, ignore_errors=True)
    fastformer = [sys.executable, "-m", "fastformer", "train", "--data-dir", str(data_dir), "--prepared-dir",
                  str(prepared_dir), "--preset", "tiny", "--device", "cpu", "--batch-tokens", "1024",
                  "--update-tokens", "2048", "--valid-every", "0", "--log-every", "1"]

    def torchrun(ranks: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]

    plans = {"first": torchrun(2) + fastformer[1:] + ["--out-dir", str(work / "run1"), "--max-steps", "1"],
             "second": torchrun(2) + fastformer[1:] + ["--out-dir", str(work / "run2"), "--max-steps", "1"],
             "resume": torchrun(2) + fastformer[1:] + ["--out-dir", str(work / "run1"), "--max-steps", "2",
                                                       "--resume"],
             "ranks4": torchrun(4) + fastformer[1:] + ["--out-dir", str(work / "run4"), "--max-steps", "1"]}
    for name in ("run1", "run2", "run4"):
        shutil.rmtree(work / name, ignore_errors=True)
    results = {}
    for name in args.runs:
        results[name] = measured_run(plans[name], work / f"{name}.log")
        print(name, json.dumps(results[name]), flush=True)
    command = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]
    bu.write_json(out, {"command": " ".join(command), **bu.environment(torch.device("cpu")),
                        "pairs": args.pairs, "data_dir": str(data_dir), "corpus_generation_s": generation,
                        "runs": results})
    print(f"wrote {out}")
    failed = [f"{name} (exit status {run['returncode']}, log {run['log']})" for name, run in results.items()
              if run["returncode"] != 0]
    if failed:
        sys.exit(f"failed: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
