"""The GPU status rows (docs/gpu.md) that a GPU check run can fill: for each GPU path, how its tests did in the junit
XML files (and the memcheck step in summary.txt) that `benchmarks/gpu_check.sh OUT_DIR` left there.

    python3 benchmarks/gpu_status.py OUT_DIR COMMIT

prints one Markdown row per path: the path, the tests that cover it, this run's count of passed / failed / skipped
tests (or "not run"), and COMMIT where every test of the path ran and passed (else the last pass in docs/gpu.md stays).
A path passes only if at least one of its tests ran and none failed, and only where OUT_DIR/environment.txt shows
that the run saw a CUDA device (without one the same tests run on the CPU, which says nothing about the GPU).
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import NamedTuple


class StatusRow(NamedTuple):
    path: str
    tests: str  # as docs/gpu.md names them
    module: str  # test module (file stem) whose test cases cover the path
    name_pattern: str  # regular expression searched in the test case's name (parameters included)
    excluded_pattern: str = r"^$"  # test cases whose name matches this are not the path's


ROWS = (
    StatusRow("attention fwd+bwd, long (flash) path, fp32/fp16/bf16", "test_attention_kernel.py, all but [short-...]",
              "test_attention_kernel", r"", r"\bshort\b"),
    StatusRow("attention fwd+bwd, short path (FASTFORMER_ATTENTION_SHORT_PATH=1)",
              "test_attention_kernel.py [short-...]", "test_attention_kernel", r"\bshort\b"),
    StatusRow("label-smoothed CE fwd+bwd (gradient in the forward launch), fp32/fp16/bf16",
              "test_cross_entropy_kernel.py: cross_entropy tests", "test_cross_entropy_kernel",
              r"cross_entropy(?!.*linear)", r"linear"),
    StatusRow("fused linear + CE (fp32-out cuBLAS matmul or its fallback)",
              "test_cross_entropy_kernel.py: linear_cross_entropy and mm_into tests", "test_cross_entropy_kernel",
              r"linear|mm_into"),
    StatusRow("residual LayerNorm fwd+bwd (backward on one wave of resident programs)", "test_layernorm_kernel.py",
              "test_layernorm_kernel", r""),
    StatusRow("fused model, base/big, bf16/fp16", "test_model_fused.py", "test_model_fused", r""),
    StatusRow("beam search, shrink every_step (the default), fp32/fp16/bf16",
              "test_beam_search.py test_cuda_* but the buckets ones, test_extension.py", "test_beam_search|test_extension",
              r"cuda", r"buckets"),
    StatusRow("beam search, shrink buckets (CUDA graphs)", "test_beam_search.py test_cuda_*[buckets...]",
              "test_beam_search", r"cuda.*buckets"),
    StatusRow("scoring, sampling, target prefixes, n-gram blocking, repetition penalty, alignments",
              "test_scoring.py, test_search_options.py, test_alignment.py: test_cuda_*",
              "test_scoring|test_search_options|test_alignment", r"cuda"),
    StatusRow("captured training step + bf16-master (--step captured)",
              "test_captured_step.py, test_benchmarks.py::test_captured_system_trains_the_tiny_model_on_the_gpu",
              "test_captured_step|test_benchmarks", r"captured|replay"),
)
MEMCHECK = "compute-sanitizer memcheck of translate (every_step and buckets)"


# The junit files gpu_check.sh's test steps write (not every *.xml: a reused OUT_DIR may hold an older run's).
JUNIT_FILES = ("pytest-gpu-marked.xml", "pytest-gpu-files.xml")


def test_cases(out_dir: Path) -> list[tuple[str, str, str]]:
    """-> (module, name, outcome: "passed" | "failed" | "skipped") of every test case in OUT_DIR's junit XML files (a
    file cut short by a step's timeout is said on stderr and not counted)."""
    cases = []
    for xml_file in (out_dir / name for name in JUNIT_FILES if (out_dir / name).exists()):
        try:
            root = ElementTree.parse(xml_file).getroot()
        except ElementTree.ParseError as error:
            print(f"gpu_status: {xml_file} is not readable junit XML ({error}): its tests are not counted",
                  file=sys.stderr)
            continue
        for case in root.iter("testcase"):
            module = case.get("classname", "").split(".")[-1]
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            else:
                outcome = "passed"
            cases.append((module, case.get("name", ""), outcome))
    return cases


def row_counts(row: StatusRow, cases: list[tuple[str, str, str]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for module, name, outcome in cases:
        if (re.fullmatch(row.module, module) and re.search(row.name_pattern, name)
                and not re.search(row.excluded_pattern, name)):
            counts[outcome] += 1
    return counts


def memcheck_status(out_dir: Path) -> str | None:
    """The memcheck step's status in OUT_DIR/summary.txt ("ok", "rc=1", ...), or None if it did not run."""
    summary = out_dir / "summary.txt"
    if not summary.exists():
        return None
    for line in summary.read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "memcheck" and fields[1] != "skipped":
            return fields[1]
    return None


def saw_a_gpu(out_dir: Path) -> bool:
    """Whether gpu_check.sh's environment.txt in OUT_DIR names a CUDA device."""
    environment = out_dir / "environment.txt"
    return environment.exists() and any(line.startswith("device:") and "no CUDA device" not in line
                                        for line in environment.read_text().splitlines())


def status_rows(out_dir: Path, commit: str) -> list[str]:
    """-> the Markdown rows "| path | tests | this run | last passed on a GPU |" (every path "not run" where the run
    saw no GPU)."""
    cases = test_cases(out_dir) if saw_a_gpu(out_dir) else []
    lines = []
    for row in ROWS:
        counts = row_counts(row, cases)
        ran = counts["passed"] + counts["failed"]
        this_run = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped" if ran
                    else "not run")
        passed = ran > 0 and counts["failed"] == 0
        lines.append(f"| {row.path} | {row.tests} | {this_run} | {commit if passed else '(unchanged)'} |")
    memcheck = memcheck_status(out_dir) if saw_a_gpu(out_dir) else None
    lines.append(f"| {MEMCHECK} | gpu_check.sh memcheck | {memcheck or 'not run'} | "
                 f"{commit if memcheck == 'ok' else '(unchanged)'} |")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="the OUT_DIR of a benchmarks/gpu_check.sh run")
    parser.add_argument("commit", help="the commit that run checked")
    args = parser.parse_args(argv)
    if not args.out_dir.is_dir():
        parser.error(f"{args.out_dir} is not a directory")
    print("| GPU path | tests | this run | last passed on a GPU |")
    print("| --- | --- | --- | --- |")
    print("\n".join(status_rows(args.out_dir, args.commit)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
