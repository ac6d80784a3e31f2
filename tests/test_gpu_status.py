"""benchmarks/gpu_status.py: the GPU status rows of docs/gpu.md from a GPU check's junit XML and summary."""

import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import gpu_status  # noqa: E402


def write_junit(path: Path, cases: list[tuple[str, str, str]]) -> None:
    """cases: (classname, name, outcome "passed" | "failed" | "skipped") -> a junit XML file as pytest writes it."""
    suite = ElementTree.Element("testsuite")
    for classname, name, outcome in cases:
        case = ElementTree.SubElement(suite, "testcase", classname=classname, name=name)
        if outcome != "passed":
            ElementTree.SubElement(case, "failure" if outcome == "failed" else "skipped")
    root = ElementTree.Element("testsuites")
    root.append(suite)
    ElementTree.ElementTree(root).write(path)


def test_rows_count_each_paths_tests_and_name_the_commit_only_where_all_passed(tmp_path):
    write_junit(tmp_path / "pytest-gpu-marked.xml", [
        ("work.tests.test_beam_search", "test_cuda_translate_low_precision[bfloat16-False]", "passed"),
        ("work.tests.test_beam_search", "test_cuda_translate_matches_reference[every_step-4]", "passed"),
        ("work.tests.test_beam_search", "test_cuda_translate_matches_reference[buckets-4]", "failed"),
        ("work.tests.test_beam_search", "test_cuda_translate_in_buckets_of_many_sentences_matches_every_step",
         "passed"),
        ("work.tests.test_captured_step", "test_every_replay_draws_new_dropout_masks_and_never_syncs", "skipped"),
    ])
    write_junit(tmp_path / "pytest-gpu-files.xml", [
        ("work.tests.test_attention_kernel", "test_kernel_tile_edges[short-float32-1]", "passed"),
        ("work.tests.test_beam_search", "test_cpu_only_rule", "passed"),
    ])
    (tmp_path / "environment.txt").write_text("commit: abc1234\ndevice: NVIDIA H100 80GB HBM3, 79 GiB, sm_90\n")
    (tmp_path / "summary.txt").write_text("install                ok          63 s\n"
                                          "memcheck               rc=1        40 s\n")
    rows = {row.split(" | ")[0][2:]: row for row in gpu_status.status_rows(tmp_path, "abc1234")}
    every_step = rows["beam search, shrink every_step (the default), fp32/fp16/bf16"]
    assert every_step.endswith("| 2 passed, 0 failed, 0 skipped | abc1234 |")
    buckets = rows["beam search, shrink buckets (CUDA graphs)"]
    assert buckets.endswith("| 1 passed, 1 failed, 0 skipped | (unchanged) |")
    short = rows["attention fwd+bwd, short path (FASTFORMER_ATTENTION_SHORT_PATH=1)"]
    assert short.endswith("| 1 passed, 0 failed, 0 skipped | abc1234 |")
    assert rows["attention fwd+bwd, long (flash) path, fp32/fp16/bf16"].endswith("| not run | (unchanged) |")
    assert rows["captured training step + bf16-master (--step captured)"].endswith("| not run | (unchanged) |")
    assert rows[gpu_status.MEMCHECK].endswith("| rc=1 | (unchanged) |")
    assert len(rows) == len(gpu_status.ROWS) + 1


def test_a_run_without_a_gpu_fills_no_row(tmp_path):
    """Without CUDA the same tests run on the CPU: their passes are not GPU passes."""
    write_junit(tmp_path / "pytest-gpu-files.xml", [("tests.test_layernorm_kernel", "test_kernel[float32]", "passed")])
    (tmp_path / "environment.txt").write_text("device: no CUDA device visible\n")
    (tmp_path / "summary.txt").write_text("memcheck               ok          40 s\n")
    assert all(row.endswith("| not run | (unchanged) |") for row in gpu_status.status_rows(tmp_path, "abc1234"))


def test_a_cut_junit_file_and_other_runs_files_are_not_counted_and_memcheck_stands_alone(tmp_path, capsys):
    """A test step cut by its timeout leaves its XML unfinished: said, the other file's tests still counted; only the
    check's own files are read (a reused OUT_DIR holds others); memcheck's row needs no test file; the search
    options' tests have their row."""
    (tmp_path / "pytest-gpu-marked.xml").write_text("<testsuites><testsuite><testcase classname='tests.test_sc")
    write_junit(tmp_path / "pytest-gpu-files.xml", [
        ("tests.test_scoring", "test_cuda_score_equals_the_reference[marian]", "passed"),
        ("tests.test_search_options", "test_cuda_options_match_the_reference_search[all-buckets]", "passed"),
        ("tests.test_search_options", "test_cpu_sampling_counts", "failed"),
    ])
    write_junit(tmp_path / "old-run.xml", [("tests.test_layernorm_kernel", "test_kernel[float32]", "failed")])
    (tmp_path / "environment.txt").write_text("device: NVIDIA H200, 139 GiB, sm_90, 132 SMs\n")
    (tmp_path / "summary.txt").write_text("memcheck               unsupported    9 s\n")
    rows = {row.split(" | ")[0][2:]: row for row in gpu_status.status_rows(tmp_path, "abc1234")}
    assert "pytest-gpu-marked.xml is not readable junit XML" in capsys.readouterr().err
    options = rows["scoring, sampling, target prefixes, n-gram blocking, repetition penalty, alignments"]
    assert options.endswith("| 2 passed, 0 failed, 0 skipped | abc1234 |")
    assert rows["residual LayerNorm fwd+bwd (backward on one wave of resident programs)"].endswith(
        "| not run | (unchanged) |")
    assert rows[gpu_status.MEMCHECK].endswith("| unsupported | (unchanged) |")


def test_the_check_refuses_a_step_it_does_not_have(tmp_path):
    """A misspelt --only step ran nothing and said "all steps passed": a lent GPU's minutes spent on nothing."""
    done = subprocess.run(["bash", str(Path(__file__).parent.parent / "benchmarks" / "gpu_check.sh"),
                           str(tmp_path / "out"), "--only", "install,kernel"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("unknown step 'kernel' in --only; the steps: ")
    assert not (tmp_path / "out" / "summary.txt").exists()
