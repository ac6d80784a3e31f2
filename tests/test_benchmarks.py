"""The benchmarks' baselines compute what they claim (against fastformer's reference and torch's FLOP counter), and
both benchmark scripts run end to end on the CPU (tiny shapes), writing their JSON and chart."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fastformer
from fastformer import Transformer, TransformerConfig
from fastformer.data.batching import DEFAULT_MAX_BUCKETS
from fastformer.decoding.compiled import extension
from fastformer.reference.beam_search import beam_search
from tolerances import FP32

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ab_throughput  # noqa: E402
import bench_utils  # noqa: E402
import cpu_decoding  # noqa: E402
import cpu_options  # noqa: E402
import baselines  # noqa: E402
import prepare_scale  # noqa: E402
import throughput  # noqa: E402
from baselines import CachedDecoder, TorchTransformer, cached_beam_search, ctranslate2_modes  # noqa: E402
from throughput import training_flops  # noqa: E402

VOCAB = 23


def padded_batch(lengths: list[int], seed: int) -> torch.Tensor:
    """Right-padded random ids in [3, VOCAB), each row ending in EOS (2)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (len(lengths), max(lengths)), generator=generator)
    for row, length in enumerate(lengths):
        tokens[row, length - 1] = 2
        tokens[row, length:] = 0
    return tokens


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoder_logits_equal_full_decode_at_every_step(norm_first):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(VOCAB, norm_first=norm_first)).eval()
    src = padded_batch([7, 3, 5], seed=1)
    prefix = torch.cat([torch.ones(3, 1, dtype=torch.long), padded_batch([6, 6, 6], seed=2)[:, :5]], dim=1)
    decoder = CachedDecoder(model)
    with torch.no_grad(), fastformer.backend("reference"):
        encoder_out = model.encode(src)
        memory, keep = decoder.encode(src)
        real = keep[:, 0, 0]
        torch.testing.assert_close(memory[real], encoder_out.memory[real], **FP32)
        state = decoder.start(memory, keep, beam_size=1)
        for step in range(prefix.shape[1]):
            logits = decoder.step(state, prefix[:, step])
            full = model.decode(prefix[:, :step + 1], encoder_out)[:, -1]
            torch.testing.assert_close(logits, full, **FP32, msg=f"step {step}")


@pytest.mark.parametrize("options", [
    dict(beam_size=1),
    dict(beam_size=4),
    dict(beam_size=3, n_best=3, min_len=2, length_penalty=1.0),
    dict(beam_size=4, min_len=1024, max_len_a=1.0, max_len_b=0),  # the benchmark's forced length
], ids=["greedy", "beam4", "nbest-minlen", "forced-length"])
def test_cached_beam_search_equals_the_reference_beam_search(options):
    torch.manual_seed(3)
    model = Transformer(TransformerConfig.tiny(VOCAB, norm_first=False)).eval()
    src = padded_batch([6, 2, 4], seed=4)
    options = dict(dict(max_len_a=0.0, max_len_b=6), **options)
    with fastformer.backend("reference"):
        expected = beam_search(model, src, **options)
        got = cached_beam_search(model, src, **options)
    assert len(got) == len(expected)
    for sentence, (ours, theirs) in enumerate(zip(got, expected)):
        assert [h.tokens for h in ours] == [h.tokens for h in theirs], f"sentence {sentence}"
        for a, b in zip(ours, theirs):
            assert abs(a.score - b.score) <= 1e-5
    if options.get("min_len") == 1024:
        # Forced length: each best hypothesis has exactly as many tokens as its source (EOS included).
        assert [len(h[0].tokens) for h in got] == [6, 2, 4]


@pytest.mark.parametrize("norm_first", [False, True])
def test_torch_transformer_baseline_is_fastformers_model(norm_first):
    """With fastformer's weights (its names differ only by the `ffn.` prefix), torch.nn's layers give the same
    logits and loss, in training mode (dropout 0), so the baseline computes the very same model."""
    torch.manual_seed(5)
    config = TransformerConfig.tiny(VOCAB, norm_first=norm_first, dropout=0.0)
    model, baseline = Transformer(config), TorchTransformer(config)
    state = {name.replace(".ffn.", "."): value for name, value in model.state_dict().items()}
    baseline.load_state_dict(state)
    src = padded_batch([5, 3, 7], seed=6)
    tgt_in, tgt_out = padded_batch([4, 6, 2], seed=7), padded_batch([4, 6, 2], seed=8)
    real = tgt_in != 0
    with fastformer.backend("reference"):
        expected_logits = model(src, tgt_in)
        expected_loss = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
    torch.testing.assert_close(baseline(src, tgt_in)[real], expected_logits[real], **FP32)
    torch.testing.assert_close(baseline.loss(src, tgt_in, tgt_out, label_smoothing=0.1), expected_loss, **FP32)


def test_training_flops_formula_matches_torchs_flop_counter():
    """One unpadded pair through the reference model: torch counts every matmul FLOP of forward + backward; the
    formula counts the causal half of decoder self-attention, so the other half is added back for the comparison."""
    config = TransformerConfig.tiny(VOCAB, dropout=0.0)
    model = Transformer(config)
    src_len, tgt_len = 9, 6
    src, tgt = padded_batch([src_len], seed=8), padded_batch([tgt_len + 1], seed=9)
    with fastformer.backend("reference"), FlopCounterMode(display=False) as counter:
        model.loss(src, tgt[:, :-1], tgt[:, 1:], reduction="sum").backward()
    d, t = config.d_model, tgt_len
    full_causal_square = 3 * config.n_decoder_layers * (4 * d * t * t - 2 * d * t * (t + 1))
    formula = training_flops(config, torch.tensor([src_len]), torch.tensor([tgt_len]))
    assert formula + full_causal_square == counter.get_total_flops()


def test_wmt_batches_respect_the_token_budget_and_the_wmt_length_distribution():
    batches = bench_utils.wmt_batches(4, max_tokens=4096, vocab_size=100, max_len=128, seed=0)
    for batch in batches:
        assert batch.src.shape[0] * max(batch.src.shape[1], batch.tgt_in.shape[1]) <= 4096
        assert torch.equal((batch.src != 0).sum(dim=1), batch.src_lengths)
        assert torch.equal((batch.tgt_out != 0).sum(dim=1), batch.tgt_lengths)
        assert torch.equal(batch.tgt_in[:, 1:], batch.tgt_out[:, :-1] * (batch.tgt_in[:, 1:] != 0))
    src, tgt = bench_utils.wmt_lengths(20000, torch.Generator().manual_seed(0), max_len=128)
    assert 25 < tgt.double().mean() < 30 and tgt.max() <= 127
    assert 25 < src.double().mean() < 31 and src.max() <= 128


def test_calls_in_turn_rotates_the_order_a_place_a_round():
    order = []
    runs = {name: (lambda name=name: order.append(name)) for name in "abc"}
    rounds_seen = []
    seconds = bench_utils.calls_in_turn(runs, 4, lambda index, so_far: rounds_seen.append((index, len(so_far["a"]))))
    assert "".join(order) == "abc" + "bca" + "cab" + "abc"
    assert rounds_seen == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert sorted(seconds) == ["a", "b", "c"] and all(len(v) == 4 and min(v) >= 0 for v in seconds.values())


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's name from /proc/cpuinfo")
def test_cpu_records_name_the_cpus_model_and_its_instruction_sets():
    import cpu_info

    lines = Path("/proc/cpuinfo").read_text().splitlines()
    def field(key: str) -> str:
        return next(line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == key)

    model = f"{field('model name')}, family {field('cpu family')} model {field('model')}"
    flags = set(next(line for line in lines if line.startswith("flags")).split(":", 1)[1].split())
    description = cpu_info.cpu_description()
    assert description.startswith(f"{model}, {os.cpu_count()} cores (")
    for flag in cpu_info.RECORDED_FLAGS:
        assert (f" {flag}" in description or f"({flag}" in description) == (flag in flags), (flag, description)
    assert bench_utils.environment(torch.device("cpu"))["device"] == description
    assert bench_utils.device_name(torch.device("cpu")) == f"cpu ({model})"
    assert cpu_info.cpu_slug().endswith(f"-{os.cpu_count()}core") and " " not in cpu_info.cpu_slug()
    assert "family" not in cpu_info.cpu_slug()


# The smoke runs tolerate a system only when the piece it needs is not built here.
MISSING_PIECE = ("cannot be imported", "fastformer._C is not built", "holds no compiled fastformer._C",
                 "No module named")


def run_script(script: str, out_dir: Path, *args: str) -> dict:
    command = [sys.executable, str(BENCHMARKS / script), "--device", "cpu", "--out-dir", str(out_dir), *args]
    environment = dict(os.environ, TRITON_INTERPRET="1")
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment,
                               cwd=BENCHMARKS.parent)
    assert (out_dir / script.replace(".py", ".json")).exists(), completed.stdout + completed.stderr
    assert (out_dir / script.replace(".py", ".png")).stat().st_size > 1000
    results = json.loads((out_dir / script.replace(".py", ".json")).read_text())
    rows = results.get("rows", []) + results.get("training", []) + results.get("inference", [])
    errors = [row for row in rows if row["status"] == "error"]
    assert all(any(piece in row["error"] for piece in MISSING_PIECE) for row in errors), errors
    # throughput.py fails a run that measured nothing (a GPU check's step would otherwise read "ok").
    nothing = script == "throughput.py" and not any(row["status"] == "ok" for row in rows)
    assert completed.returncode == (1 if errors or nothing else 0), completed.stdout + completed.stderr
    assert ("nothing was measured" in completed.stderr) == nothing
    assert results["environment"]["torch"] == torch.__version__
    assert results["environment"]["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS")
    return results


def test_the_cpu_run_leaves_out_its_slow_systems_unless_named():
    from throughput import parse_args

    settings, _ = parse_args(["--device", "cpu"])
    assert settings.train_systems == ["fastformer", "reference", "torch-nn"]
    assert settings.batching == "buckets"
    assert settings.infer_systems == ["fastformer", "cached-pytorch", "reference", "ctranslate2", "ctranslate2-int8",
                                      "ctranslate2-inter", "ctranslate2-int8-inter"]
    settings, _ = parse_args(["--device", "cpu", "--systems", "transformers,reference-compile"])
    assert (settings.train_systems, settings.infer_systems) == (["reference-compile"], ["transformers"])
    settings, _ = parse_args(["--device", "cuda", "--infer", "--out-dir", "unused"])  # inter_threads: a CPU thing
    assert not {"ctranslate2-inter", "ctranslate2-int8-inter"} & set(settings.infer_systems)


def test_throughput_smoke_run_on_cpu(tmp_path):
    engines = ("ctranslate2", "ctranslate2-int8", "ctranslate2-inter", "ctranslate2-int8-inter", "transformers")
    every_system = ",".join(("fastformer", "reference", "reference-compile", "torch-nn", "cached-pytorch", *engines))
    results = run_script("throughput.py", tmp_path, "--preset", "tiny", "--max-tokens", "128", "--batches", "1",
                         "--warmup", "0", "--repeats", "1", "--sentences", "6", "--reference-sentences", "2",
                         "--latency-sentences", "1", "--systems", every_system)
    assert {row["system"] for row in results["training"]} == {"fastformer", "reference", "reference-compile",
                                                              "torch-nn"}
    assert {row["system"] for row in results["inference"]} == {"fastformer", "cached-pytorch", "reference", *engines}
    for row in results["training"] + results["inference"]:
        if row["status"] == "ok":
            assert row["tokens_per_s"]["median"] > 0
    for row in results["training"]:
        if row["status"] == "ok":
            assert 0 < row["real_token_ratio"]["source"] <= 1 and 0 < row["real_token_ratio"]["target"] <= 1
    # An ok row decoded fastformer's forced tokens; the engines, taking one length a call, decode more in a batch of
    # sources of several lengths, and say so.
    for row in results["inference"]:
        assert row["tokens_match"] == (row["status"] == "ok") or row["status"] not in ("ok", "mismatch"), row
    cached = next(row for row in results["inference"] if row["system"] == "cached-pytorch")
    assert cached["status"] != "ok" or cached["same_tokens_as_fastformer"] == 1.0, cached
    assert [t["target"] for t in results["targets"]]


def test_throughput_infers_in_the_compute_type_asked(tmp_path):
    """--compute-type reaches fastformer's translate (its rows say so, and decode every forced token) and no other
    system's."""
    results = run_script("throughput.py", tmp_path, "--infer", "--preset", "tiny", "--sentences", "4",
                         "--latency-sentences", "1", "--systems", "fastformer,cached-pytorch", "--compute-type", "int8")
    rows = {row["system"]: row for row in results["inference"]}
    assert rows["fastformer"]["compute_type"] == "int8" and rows["fastformer"]["tokens_match"]
    assert rows["cached-pytorch"]["compute_type"] is None and rows["cached-pytorch"]["status"] == "ok"


def test_kernels_smoke_run_on_cpu(tmp_path):
    results = run_script("kernels.py", tmp_path, "--quick")
    ops = {row["op"] for row in results["rows"]}
    assert ops == {"attention", "cross_entropy", "linear_cross_entropy", "residual_layer_norm", "copy"}
    assert all(row["ms"]["median"] > 0 for row in results["rows"] if row["status"] == "ok")

def _where_ctranslate2(systems: list[str]) -> list[str]:
    """systems where the ctranslate2 package imports, else none."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return []
    return systems


def _run_cpu_benchmark(tmp_path, script: str, *args: str) -> dict:
    """Runs a CPU benchmark script on the tiny shape (300-token vocabulary, one round) -> its JSON."""
    out = tmp_path / "results.json"
    command = [sys.executable, str(BENCHMARKS / script), "--shape", "a", "--vocab", "300", "--rounds", "1", *args,
               "--out", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=BENCHMARKS.parent)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return json.loads(out.read_text())


def test_cpu_decoding_smoke_run(tmp_path):
    """The CPU decoding comparison decodes every hypothesis to its fixed length in every system, compute type and
    CTranslate2 threading mode it is given, reports rates, checksums, warm-up calls and, for fastformer, the share of
    the GEMM floor, and takes each point's ratios against CTranslate2's best row there."""
    systems = (["fastformer-float32", "fastformer-int8"]
               + _where_ctranslate2(["ctranslate2-float32", "ctranslate2-int8"]))
    results = _run_cpu_benchmark(tmp_path, "cpu_decoding.py", "--sentences", "8", "1", "--threads", "1", "2",
                                 "--beam", "2", "--source-tokens", "6", "--systems", *systems)
    rows = results["rows"]
    expected = [(system, mode.threading, mode.isa or "its own pick", threads, n) for system in systems
                for threads in (1, 2) for n in (8, 1) if system.startswith("ctranslate2")
                for mode in ctranslate2_modes(threads, isa_capped=False)]
    expected += [(system, "intra", None, threads, n) for system in systems for threads in (1, 2) for n in (8, 1)
                 if system.startswith("fastformer")]
    assert sorted(((row["system"], row["threading"], row.get("ctranslate2_isa"), row["threads"], row["sentences"])
                   for row in rows), key=str) == sorted(expected, key=str)
    for row in rows:
        assert row["tokens_per_s"] > 0 and len(row["checksum"]) == 8 and 2 <= row["warmup_calls"][0] <= 8
        if row["system"].startswith("ctranslate2"):
            assert row | baselines.Ctranslate2Mode(row["threading"]).settings(row["threads"], row["sentences"]) == row
        assert (row["beam"], row["source_tokens"], row["target_tokens"]) == (2, 6, 10)
        tokens, seconds = row["sentences"] * 10, row["seconds"]  # the JSON rounds seconds to 4 decimals, rates to 1
        assert tokens / (seconds + 5e-5) - 0.05 <= row["tokens_per_s"] <= tokens / (seconds - 5e-5) + 0.05
        if row["system"].startswith("fastformer"):
            floor, search = row["gemm_floor_seconds"], row["search_seconds_beside_floor"]
            assert 0 < floor and 0 < search
            # Within the roundings of the seconds (4 decimals) and the share (3).
            share = row["share_of_gemm_floor"]
            assert (floor - 5e-5) / (search + 5e-5) - 5e-4 <= share <= (floor + 5e-5) / (search - 5e-5) + 5e-4
            groups = extension().cpu_sentence_groups(row["sentences"], row["sentences"] * row["beam"],
                                                     row["system"].split("-", 1)[1], row["threads"])
            # Within the roundings of seconds (4 decimals), step_weight_mib and the rate itself (1 decimal each).
            read_gb = groups * (row["step_weight_mib"] + 0.05) * 2 ** 20 * 10 / 1e9
            low_gb = groups * (row["step_weight_mib"] - 0.05) * 2 ** 20 * 10 / 1e9
            assert low_gb / (seconds + 5e-5) - 0.05 <= row["weight_read_gb_s"] <= read_gb / (seconds - 5e-5) + 0.05
    assert len(results["comparisons"]) == 4  # (threads, sentences)
    assert set(results["copy_bandwidth_gb_s"]) == {"1", "2"} and min(results["copy_bandwidth_gb_s"].values()) > 0
    for entry in results["comparisons"]:
        at_point = [row for row in rows
                    if (row["threads"], row["sentences"]) == (entry["threads"], entry["sentences"])]
        fastest = max(row["tokens_per_s"] for row in at_point if row["system"].startswith("fastformer"))
        if "ctranslate2-int8" in systems:
            best_peer = max(row["tokens_per_s"] for row in at_point if row["system"].startswith("ctranslate2"))
            assert entry["fastest"]["ratio"] == pytest.approx(fastest / best_peer, rel=1e-2, abs=1e-3)
    if "ctranslate2-int8" in systems:
        lowest = min(entry["fastest"]["ratio"] for entry in results["comparisons"])
        assert results["worst"]["fastest"]["fastest"]["ratio"] == lowest


def test_a_decoding_steps_weights_are_the_decoders_matrices_but_the_cross_attention_keys_and_values():
    from cpu_decoding import step_weight_bytes

    model = Transformer(TransformerConfig.tiny(300))
    d = model.config.d_model
    matrices = [p for p in model.decoder.parameters() if p.dim() == 2]
    cross_keys_values = model.config.n_decoder_layers * 2 * d * d  # made once per search, not per step
    elements = sum(p.numel() for p in matrices) - cross_keys_values + model.output_weight.numel()
    assert step_weight_bytes(model.config, "float32") == 4 * elements
    assert step_weight_bytes(model.config, "int8") == elements


def test_real_token_ratios_count_the_unpadded_tokens():
    from throughput import real_token_ratios

    batches = bench_utils.wmt_batches(3, 512, VOCAB, 64, seed=4)
    pad = 0  # make_batch's pad id
    real_src = sum(int((batch.src != pad).sum()) for batch in batches)
    real_tgt = sum(int((batch.tgt_out != pad).sum()) for batch in batches)
    ratios = real_token_ratios(batches)
    assert ratios["source"] == pytest.approx(real_src / sum(batch.src.numel() for batch in batches))
    assert ratios["target"] == pytest.approx(real_tgt / sum(batch.tgt_out.numel() for batch in batches))
    assert 0 < ratios["source"] < 1 and 0 < ratios["target"] < 1


def bucket_real_shares(batches: list) -> tuple[float, float]:
    """Real share of the source and target tokens, counted as the non-pad ids of the rows that hold pairs (a filler
    row's EOS is not a real token) over every position, fillers included."""
    pad = 0
    real_src = sum(int((batch.src[:batch.pairs] != pad).sum()) for batch in batches)
    real_tgt = sum(int((batch.tgt_out[:batch.pairs] != pad).sum()) for batch in batches)
    return (real_src / sum(batch.src.numel() for batch in batches),
            real_tgt / sum(batch.tgt_out.numel() for batch in batches))


def test_bucketed_benchmark_batches_hold_every_sentence_once_with_90_percent_real_tokens():
    """The whole bucketed sample of a run (WMT lengths up to 128 tokens) in its static-shape batches."""
    max_tokens, max_len, seed = 1024, 128, 3
    n_sentences = bench_utils.bucket_sample_size(max_tokens)
    src_lengths, tgt_lengths, epoch = bench_utils.wmt_bucket_epoch(n_sentences, max_tokens, max_len, seed)
    # The sample is the WMT length model's: the same lengths as drawn directly.
    expected_src, expected_tgt = bench_utils.wmt_lengths(n_sentences, torch.Generator().manual_seed(seed), max_len)
    assert torch.equal(src_lengths, expected_src) and torch.equal(tgt_lengths, expected_tgt + 1)
    assert sorted(i for bucket in epoch for i in bucket.indices) == list(range(n_sentences))
    batches = bench_utils.collate_buckets(epoch, src_lengths, tgt_lengths, VOCAB, seed)
    assert len({(batch.src.shape, batch.tgt_in.shape) for batch in batches}) <= DEFAULT_MAX_BUCKETS
    for bucket, batch in zip(epoch, batches):
        assert (batch.src.shape[0], batch.src.shape[1], batch.tgt_in.shape[1]) == tuple(bucket.shape)
        assert batch.pairs == len(bucket.indices)
        # Each row holds its pair whole: as many non-pad ids as the sampled lengths, EOS last, tgt_in = [BOS, y].
        assert torch.equal((batch.src[:batch.pairs] != 0).sum(dim=1), expected_src[bucket.indices])
        assert torch.equal((batch.tgt_out[:batch.pairs] != 0).sum(dim=1), expected_tgt[bucket.indices] + 1)
        rows = torch.arange(batch.pairs)
        assert torch.all(batch.src[rows, expected_src[bucket.indices] - 1] == 2)
        assert torch.all(batch.tgt_in[:batch.pairs, 0] == 1)
        real = batch.tgt_in[:batch.pairs, 1:] != 0
        assert torch.equal(batch.tgt_in[:batch.pairs, 1:][real], batch.tgt_out[:batch.pairs, :-1][real])
        # Filler rows carry no target token.
        assert not torch.any(batch.tgt_out[batch.pairs:] != 0)
    src_share, tgt_share = bucket_real_shares(batches)
    assert src_share >= 0.90 and tgt_share >= 0.90, (src_share, tgt_share)


@pytest.mark.parametrize("n_batches, max_tokens, max_len", [(6, 25000, 128), (1, 256, 64)],
                         ids=["gpu-default", "cpu-smoke"])
def test_timed_bucket_batches_are_90_percent_real_tokens(n_batches, max_tokens, max_len):
    """The batches the runs time (the GPU run's default and the CPU smoke run's), and the row's ratios of them."""
    from throughput import real_token_ratios

    batches = bench_utils.wmt_bucket_batches(n_batches, max_tokens, VOCAB, max_len, seed=0)
    assert len(batches) == n_batches
    assert all(batch.src.shape[0] * max(batch.src.shape[1], batch.tgt_in.shape[1]) <= max_tokens for batch in batches)
    src_share, tgt_share = bucket_real_shares(batches)
    assert src_share >= 0.90 and tgt_share >= 0.90, (src_share, tgt_share)
    ratios = real_token_ratios(batches)
    assert ratios["source"] == pytest.approx(src_share) and ratios["target"] == pytest.approx(tgt_share)
    assert sum(batch.target_tokens for batch in batches) == sum(int((b.tgt_out != 0).sum()) for b in batches)


def test_captured_system_off_cuda_is_a_skipped_row_with_its_reason(tmp_path):
    results = run_script("throughput.py", tmp_path, "--train", "--preset", "tiny", "--systems", "fastformer-captured")
    (row,) = results["training"]
    assert row["system"] == "fastformer-captured" and row["status"] == "skipped"
    assert "not runnable on cpu" in row["error"] and "CUDA" in row["error"]


def test_a_peer_not_installed_is_a_skipped_row_not_a_failed_run(tmp_path, monkeypatch):
    """The GPU machine has no CTranslate2: its rows said "error" and failed every check that reached inference.
    A missing peer package is a skipped row; another missing module is still an error."""
    results = {"training": [], "inference": []}
    record = throughput.Recorder(results, SimpleNamespace(time_budget_s=None), lambda: None)
    for name in ("ctranslate2", "fastformer._C"):
        def missing(name=name):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        record("inference", {"preset": "tiny", "system": name, "runs": 1}, missing)
    assert [(row["status"], row["error"]) for row in results["inference"]] == [
        ("skipped", "not installed: ctranslate2"), ("error", "ModuleNotFoundError: No module named 'fastformer._C'")]


def test_captured_system_needs_bucketed_batches(capsys):
    from throughput import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--batching", "tokens", "--systems", "fastformer-captured"])
    assert "fastformer-captured replays one CUDA graph per batch shape: it needs --batching buckets" in \
        capsys.readouterr().err


@pytest.mark.gpu
def test_captured_system_trains_the_tiny_model_on_the_gpu():
    from throughput import measure_training_with_fallback, parse_args

    settings, _ = parse_args(["--device", "cuda", "--preset", "tiny", "--train", "--systems", "fastformer-captured",
                              "--batches", "3", "--repeats", "2", "--warmup", "0"])
    row = measure_training_with_fallback("fastformer-captured", "tiny", 256, settings, torch.device("cuda"))
    assert row["status"] == "ok", row
    assert all(math.isfinite(rate) and rate > 0 for rate in row["tokens_per_s"]["samples"])
    assert row["real_token_ratio"]["target"] >= 0.90 and row["peak_memory_gib"] > 0


def test_cpu_options_smoke_run(tmp_path):
    """The options benchmark times every fastformer system it is given (and CTranslate2's sampling and scoring in
    both threading modes where installed), each decoding or scoring the same target tokens, and takes its ratios
    from the rows' medians."""
    systems = (["beam4", "beam4-baseline", "beam4-ngram", "beam4-attention", "greedy", "sampling", "score"]
               + _where_ctranslate2(["ctranslate2-sampling", "ctranslate2-score"]))
    # The package under test as the "earlier" one: the directory it is installed in.
    results = _run_cpu_benchmark(tmp_path, "cpu_options.py", "--threads", "2", "--systems", *systems,
                                 "--baseline-path", str(Path(fastformer.__file__).resolve().parent.parent))
    rows = results["rows"]
    expected = {name for system in systems
                for name in ([f"{system} {mode.name}" for mode in ctranslate2_modes(2, isa_capped=False)]
                             if system.startswith("ctranslate2") else [system])}
    assert set(rows) == expected and not results["failed"]
    for row in rows.values():
        assert row["tokens"] == 64 * 31  # every system decodes (or scores) 31 target tokens of 64 sentences
        # tokens_per_s from the seconds before the JSON rounds them to 4 decimals: up to 5e-5 s apart, which is a
        # percent of a smoke run's few milliseconds.
        assert row["tokens"] / row["tokens_per_s"] == pytest.approx(row["seconds"], abs=6e-5)
    ratios = results["ratios"]
    assert ratios["beam4-ngram time / beam4 time"] == pytest.approx(
        rows["beam4"]["tokens_per_s"] / rows["beam4-ngram"]["tokens_per_s"], rel=1e-2)
    assert ratios["sampling / greedy (speed)"] == pytest.approx(
        rows["sampling"]["tokens_per_s"] / rows["greedy"]["tokens_per_s"], rel=1e-2)
    # One round: each paired ratio is the rows' own (CTranslate2's faster mode for its systems).
    paired = results["paired"]
    assert set(paired) == {name for name in ratios if name in cpu_options.PAIRS}
    assert {"beam4 / beam4-baseline (speed)", "sampling / greedy (speed)"} <= set(paired)
    for name in paired:
        assert paired[name]["median"] == pytest.approx(ratios[name], rel=1e-2)
    if "ctranslate2-score" in systems:
        best = max(row["tokens_per_s"] for name, row in rows.items() if name.startswith("ctranslate2-score "))
        assert ratios["score / CTranslate2 score_batch at its best"] == pytest.approx(
            rows["score"]["tokens_per_s"] / best, rel=1e-2)


@pytest.mark.parametrize("flags, capped, isas", [
    ("avx2 avx512f avx512bw avx512dq avx512vl", False, [None, "AVX512"]),
    ("avx2 avx512f avx512bw avx512dq avx512vl", True, [None]),
    ("avx2 avx512f", False, [None]),
    ("avx2", False, [None])])
def test_ctranslate2_modes_add_its_kernels_forced_to_avx512(monkeypatch, flags, capped, isas):
    """CTranslate2 is timed in both threadings on several threads, and on a CPU with the AVX-512 it needs (F, BW, DQ,
    VL) also with its own kernels forced to AVX-512, unless the run caps the instruction set."""
    monkeypatch.setattr(baselines, "cpu_name_and_flags", lambda: ("a CPU", set(flags.split())))
    for threads, threadings in ((1, ["intra"]), (2, ["intra", "inter"])):
        modes = ctranslate2_modes(threads, isa_capped=capped)
        assert [(mode.threading, mode.isa) for mode in modes] == [(t, isa) for isa in isas for t in threadings]
        assert [mode.name for mode in modes] == [f"{t} {isa}" if isa else t for isa in isas for t in threadings]


def test_cpu_options_pairs_systems_round_by_round():
    """A paired ratio divides the two systems' seconds within each round (CTranslate2 at its faster mode in that
    round), not the medians over the rounds; a system missing a round gives no pair."""
    def samples(*seconds: float) -> list[dict]:
        return [{"seconds": value} for value in seconds]

    timed = {("sampling", "intra"): samples(1.0, 2.0, 1.5),
             ("ctranslate2-sampling", "intra"): samples(3.0, 3.0, 3.0),
             ("ctranslate2-sampling", "inter"): samples(2.0, 5.0, 4.5),
             ("greedy", "intra"): samples(1.0, 1.0)}
    # Rounds: 2.0 / 1.0, 3.0 / 2.0, 3.0 / 1.5; the medians' ratio (3.0 / 1.5) would hide the range.
    assert cpu_options.paired_ratios(timed, 3) == {
        "sampling / CTranslate2 sampling at its best": {"median": 2.0, "min": 1.5, "max": 2.0}}


def test_cpu_options_one_process_takes_each_ratio_within_a_round(tmp_path):
    """--one-process: every system once a round in one process, each ratio's median and range over the rounds'
    own ratios (an option's time over beam4's in the same round)."""
    results = _run_cpu_benchmark(tmp_path, "cpu_options.py", "--threads", "1", "--one-process", "--rounds", "3",
                                 "--systems", "beam4", "beam4-ngram", "greedy", "sampling")
    seconds = results["seconds"]
    assert set(seconds) == {"beam4", "beam4-ngram", "greedy", "sampling"}
    assert all(len(values) == 3 and min(values) > 0 for values in seconds.values())
    per_round = sorted(n / b for n, b in zip(seconds["beam4-ngram"], seconds["beam4"]))
    assert results["ratios"]["beam4-ngram time / beam4 time"] == pytest.approx(
        {"median": per_round[1], "min": per_round[0], "max": per_round[2]}, abs=2e-3)
    speed = sorted(g / s for g, s in zip(seconds["greedy"], seconds["sampling"]))
    assert results["ratios"]["sampling / greedy (speed)"]["median"] == pytest.approx(speed[1], abs=2e-3)


def _fake_cpu_options_worker(monkeypatch, modes: list) -> list[dict]:
    """cpu_options.py's workers replaced by one that fails in a mode forcing AVX-512 and otherwise prints a timing
    (fastformer's 1 s, CTranslate2's 0.5 s), CTranslate2 run in `modes` -> each worker's environment, as started."""
    started = []

    def run(command: list[str], env: dict[str, str], **_) -> subprocess.CompletedProcess:
        started.append(env)
        if env.get("CT2_FORCE_CPU_ISA") == "AVX512":
            return subprocess.CompletedProcess(command, 1, "", "no AVX-512 here\n")
        seconds = 0.5 if command[command.index("--worker") + 1].startswith("ctranslate2") else 1.0
        return subprocess.CompletedProcess(command, 0, json.dumps({"seconds": seconds, "tokens": 10,
                                                                    "warmup_calls": 2}), "")

    monkeypatch.setattr(cpu_options, "subprocess", SimpleNamespace(run=run))  # not git's, which bench_utils runs
    monkeypatch.setattr(cpu_options, "ctranslate2_modes", lambda threads, isa_capped: modes)
    return started


def test_cpu_options_leaves_out_a_system_that_failed_in_one_mode(tmp_path, monkeypatch, capsys):
    """A CTranslate2 mode that fails drops the system's other modes' rows too (their ratios would not be against
    CTranslate2 at its best), saying so; "its own pick" runs without a CT2_FORCE_CPU_ISA exported in the shell; the
    JSON records CTranslate2's version, OMP_NUM_THREADS in the command and each CTranslate2 row's settings."""
    started = _fake_cpu_options_worker(monkeypatch, [baselines.Ctranslate2Mode("intra"),
                                                     baselines.Ctranslate2Mode("intra", "AVX512")])
    monkeypatch.setenv("CT2_FORCE_CPU_ISA", "AVX2")
    out = tmp_path / "options.json"
    arguments = ["--shape", "a", "--vocab", "64", "--rounds", "1", "--out", str(out), "--systems", "sampling",
                 "ctranslate2-sampling"]
    monkeypatch.setattr(sys, "argv", ["cpu_options.py", "--threads", "1", *arguments])
    cpu_options.main()
    # fastformer's worker loads no CTranslate2: its environment is the shell's.
    assert [env.get("CT2_FORCE_CPU_ISA") for env in started] == ["AVX2", None, "AVX512"]
    assert "ctranslate2-sampling failed: no AVX-512 here (intra AVX512); its rows and ratios are left out" in (
        capsys.readouterr().out)
    results = json.loads(out.read_text())
    assert list(results["rows"]) == ["sampling"] and results["ratios"] == {} and results["paired"] == {}
    assert results["failed"] == {"ctranslate2-sampling": "no AVX-512 here (intra AVX512)"}
    assert results["ctranslate2"] == bench_utils.ctranslate2_version()
    assert results["command"].startswith(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python ")

    _fake_cpu_options_worker(monkeypatch, [baselines.Ctranslate2Mode("inter")])
    monkeypatch.setattr(sys, "argv", ["cpu_options.py", "--threads", "2", *arguments])
    cpu_options.main()
    results = json.loads(out.read_text())
    assert results["rows"]["ctranslate2-sampling"] | {"intra_threads": 1, "inter_threads": 2, "max_batch_size": 32} == (
        results["rows"]["ctranslate2-sampling"])
    assert results["ratios"]["sampling / CTranslate2 sampling at its best"] == 0.5


def test_cpu_options_one_process_names_the_systems_it_skips(capsys):
    """--one-process with none of the systems it times is a one-line error; with some, the rest are named."""
    with pytest.raises(SystemExit):
        cpu_options.parse_args(["--one-process", "--systems", "score", "ctranslate2-score"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --one-process times none of --systems score ctranslate2-score: only beam4, " in error, error
    assert cpu_options.parse_args(["--one-process", "--systems", "beam4", "score"]).systems == ["beam4", "score"]
    assert "--one-process skips score (it times only beam4, " in capsys.readouterr().err


def test_cpu_decoding_keeps_an_exported_isa_out_of_ctranslate2s_own_pick(monkeypatch):
    """CTranslate2's "its own pick" worker runs without a CT2_FORCE_CPU_ISA exported in the shell (its rows would
    be another ISA's), unless --cap-isa set it; a forced mode sets its own."""
    own, forced = baselines.Ctranslate2Mode("intra"), baselines.Ctranslate2Mode("intra", "AVX512")
    parent = {"CT2_FORCE_CPU_ISA": "AVX2", "PATH": "/bin"}
    assert own.environment(parent) == {"PATH": "/bin"}
    assert own.environment(parent, cap="AVX2") == parent
    assert forced.environment(parent) == {"CT2_FORCE_CPU_ISA": "AVX512", "PATH": "/bin"}
    started = []

    def run(command: list[str], env: dict[str, str], **_) -> subprocess.CompletedProcess:
        started.append(env.get("CT2_FORCE_CPU_ISA"))
        return subprocess.CompletedProcess(command, 0, json.dumps({"1": [0.1, "00000000", 2]}), "")

    monkeypatch.setattr(cpu_decoding, "subprocess", SimpleNamespace(run=run))
    monkeypatch.setattr(cpu_decoding, "ctranslate2_modes", lambda threads, capped: [own] if capped else [own, forced])
    monkeypatch.setenv("CT2_FORCE_CPU_ISA", "AVX2")
    point = cpu_decoding.Point(1, 4, 20, (1,))
    for cap, isas in ((None, [None, "AVX512"]), ("avx2", ["AVX2"])):
        started.clear()
        args = cpu_decoding.build_parser().parse_args(["--systems", "ctranslate2-int8", "--rounds", "1"]
                                                      + (["--cap-isa", cap] if cap else []))
        timed, failed = cpu_decoding.time_in_rounds(args, [point])
        assert started == isas and not failed and len(timed) == len(isas)


def test_cpu_shortlist_smoke_run(tmp_path):
    """The shortlist benchmark times every point with and without the shortlist, in that order, in fastformer and
    (where installed) CTranslate2 in each threading mode, and counts the ids a batch keeps and the weights a step
    reads then."""
    results = _run_cpu_benchmark(tmp_path, "cpu_shortlist.py")
    rows, vocab, d = results["rows"], 300, 64
    systems = {(1, "fastformer"), (2, "fastformer")} | set(_where_ctranslate2(
        [(1, "ctranslate2 intra"), (2, "ctranslate2 intra"), (2, "ctranslate2 inter")]))
    assert sorted((r["threads"], r["system"], r["sentences"], r["shortlist"]) for r in rows) == sorted(
        (threads, system, n, kept) for threads, system in systems for n in (1, 8, 64) for kept in (False, True))
    for full, short, speedup in zip(rows[::2], rows[1::2], results["speedups"]):
        assert full["system"] == short["system"] == speedup["system"] and not full["shortlist"] and short["shortlist"]
        assert full["kept_ids"] == vocab and 100 < short["kept_ids"] <= vocab
        assert full["step_weight_bytes"] - short["step_weight_bytes"] == (vocab - short["kept_ids"]) * d
        assert speedup["speedup"] == pytest.approx(short["tokens_per_s"] / full["tokens_per_s"], rel=1e-2)
        for row in (full, short):
            assert row["tokens_per_s"] == pytest.approx(row["sentences"] * 31 / row["seconds"], rel=1e-2)
            if row["system"] != "fastformer":
                assert row | baselines.Ctranslate2Mode(row["system"].split()[1]).settings(
                    row["threads"], row["sentences"]) == row and "max_batch_size" in row
    assert results["ctranslate2"] == bench_utils.ctranslate2_version()
    assert results["command"].startswith(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python ")


def _sources(root: Path, files: dict[str, str]) -> Path:
    """A tree of fastformer/ and triton_kernels/ Python files under root -> root."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_run_names_an_install_whose_sources_are_not_the_checkouts_stale(tmp_path, monkeypatch):
    """An install not redone after an edit: its fastformer or triton_kernels sources differ from the working tree's
    (a file changed, added or missing), and the commit says so; the environment names the package's folder."""
    files = {"fastformer/__init__.py": "x = 1\n", "fastformer/data/reading.py": "y = 2\n",
             "triton_kernels/__init__.py": ""}
    checkout = _sources(tmp_path / "checkout", files)

    def packages(installed: Path) -> dict:
        return {name: installed / name if (installed / name).is_dir() else None for name in bench_utils.SOURCE_PACKAGES}

    assert not bench_utils.stale_install(packages(_sources(tmp_path / "same", files)), checkout)
    assert not bench_utils.stale_install(packages(checkout), checkout)
    edited = {**files, "fastformer/data/reading.py": "y = 3\n"}
    assert bench_utils.stale_install(packages(_sources(tmp_path / "edited", edited)), checkout)
    added = {**files, "fastformer/new.py": ""}
    assert bench_utils.stale_install(packages(_sources(tmp_path / "added", added)), checkout)
    no_kernels = {name: text for name, text in files.items() if name.startswith("fastformer/")}
    assert bench_utils.stale_install(packages(_sources(tmp_path / "no-kernels", no_kernels)), checkout)
    # A copy of benchmarks/ alone has no sources to compare with.
    assert not bench_utils.stale_install(packages(tmp_path / "edited"), tmp_path / "empty")

    monkeypatch.setenv("FASTFORMER_COMMIT", "abc1234")
    monkeypatch.setattr(bench_utils, "imported_packages", lambda: packages(tmp_path / "edited"))
    assert bench_utils.git_commit() == "abc1234+stale-install"
    assert bench_utils.environment(torch.device("cpu"))["fastformer_path"] == str(tmp_path / "edited" / "fastformer")
    monkeypatch.undo()
    assert bench_utils.environment(torch.device("cpu"))["fastformer_path"] == str(
        Path(fastformer.__file__).resolve().parent)


def test_fastformer_commit_names_the_tree_even_in_a_git_checkout(monkeypatch):
    monkeypatch.setattr(bench_utils, "imported_packages",
                        lambda: {name: bench_utils.REPO / name for name in bench_utils.SOURCE_PACKAGES})
    monkeypatch.setenv("FASTFORMER_COMMIT", "0097ec4")
    assert bench_utils.git_commit() == "0097ec4"
    monkeypatch.delenv("FASTFORMER_COMMIT")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bench_utils.REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert bench_utils.git_commit().split("+")[0] == head.stdout.strip()


FAKE_THROUGHPUT = '''import argparse, json, os
from pathlib import Path
parser = argparse.ArgumentParser()
parser.add_argument("--train", action="store_true")
parser.add_argument("--out-dir", type=Path)
args = parser.parse_args()
rows = [{"status": "ok", "preset": "tiny", "system": "fastformer", "tokens_per_s": {"median": 100.0}}]
environment = {"commit": os.environ.get("FASTFORMER_COMMIT")}
(args.out_dir / "throughput.json").write_text(json.dumps({"environment": environment, "training": rows}))
'''


def test_ab_runs_record_their_own_trees_commit_and_a_failed_run_names_its_log(tmp_path, monkeypatch):
    tree = _sources(tmp_path / "tree", {"benchmarks/throughput.py": FAKE_THROUGHPUT})
    monkeypatch.setenv("FASTFORMER_COMMIT", "the-head")  # the head's, which the baseline's run must not take
    run = ab_throughput.run_benchmark("throughput", tree, "abc1234", ["--train"], tmp_path / "ok")
    assert run == {"rates": {"training tiny fastformer": 100.0}, "environment": {"commit": "abc1234"}}
    with pytest.raises(SystemExit) as failed:
        ab_throughput.run_benchmark("throughput", tree, "abc1234", ["--train", "--bogus"], tmp_path / "ok")
    message = str(failed.value)
    assert "abc1234" in message and "unrecognized arguments: --bogus" in message
    assert str(tmp_path / "ok" / "throughput.log") in message and "\n" not in message


FAKE_CPU_DECODING = '''import argparse, json
from pathlib import Path
parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path)
point = {"status": "ok", "threads": 1, "beam": 4, "sentences": 64, "source_tokens": 20}
rows = [{"system": "ctranslate2-int8", "threading": "intra", "ctranslate2_isa": "its own pick", "tokens_per_s": 100.0},
        {"system": "ctranslate2-int8", "threading": "intra", "ctranslate2_isa": "AVX512", "tokens_per_s": 120.0},
        {"system": "fastformer-int8", "threading": "intra", "tokens_per_s": 90.0}]
parser.parse_args().out.write_text(json.dumps({"rows": [{**point, **row} for row in rows]}))
'''


def test_ab_keys_ctranslate2s_rows_by_their_isa_too(tmp_path):
    """cpu_decoding.py's rows of CTranslate2 at its own pick and forced to AVX-512 are two rates, not one the other
    overwrites."""
    tree = _sources(tmp_path / "tree", {"benchmarks/cpu_decoding.py": FAKE_CPU_DECODING})
    rates = ab_throughput.run_benchmark("cpu_decoding", tree, "abc1234", [], tmp_path / "out")["rates"]
    point = "threads=1 beam=4 sentences=64 source=20"
    assert rates == {f"ctranslate2-int8 intra {point}": 100.0, f"ctranslate2-int8 intra AVX512 {point}": 120.0,
                     f"fastformer-int8 intra {point}": 90.0}


@pytest.mark.parametrize("arguments, error", [
    (["--baseline", "nosuchcommit"], "--baseline nosuchcommit is no commit of"),
    (["--baseline", "HEAD", "--rounds", "0"], "argument --rounds: must be at least 1, not 0")])
def test_ab_refuses_a_baseline_that_is_no_commit_and_zero_rounds(tmp_path, arguments, error):
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "ab_throughput.py"), *arguments, "--work-dir",
                                str(tmp_path / "work"), "--out-dir", str(tmp_path / "out"), "--", "--train"],
                               capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent)
    assert completed.returncode == 2 and error in completed.stderr, completed.stderr
    assert "Traceback" not in completed.stderr and not (tmp_path / "out").exists()


def test_cpu_options_refuses_a_baseline_it_cannot_time(tmp_path, capsys):
    for arguments, error in ((["--systems", "beam4", "beam4-baseline", "--baseline-path", "/does/not/exist"],
                              "--baseline-path /does/not/exist holds no fastformer package"),
                             (["--systems", "beam4-baseline"], "beam4-baseline times the package in --baseline-path")):
        with pytest.raises(SystemExit):
            cpu_options.parse_args(arguments)
        assert error in capsys.readouterr().err
    assert "beam4-baseline" not in cpu_options.parse_args([]).systems
    installed = Path(fastformer.__file__).resolve().parent.parent
    assert "beam4-baseline" in cpu_options.parse_args(["--baseline-path", str(installed)]).systems
    # A folder that holds a fastformer package the worker does not import: its row fails, naming both.
    other = _sources(tmp_path / "other", {"fastformer/__init__.py": ""})
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "cpu_options.py"), "--worker", "beam4-baseline",
                                "--baseline-path", str(other), "--shape", "a", "--vocab", "64"],
                               capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent)
    assert completed.returncode != 0 and f"not from --baseline-path {other}" in completed.stderr, completed.stderr


def test_an_inference_row_that_decodes_other_tokens_is_no_ok_row(monkeypatch):
    settings, _ = throughput.parse_args(["--device", "cpu"])
    model = Transformer(TransformerConfig.tiny(VOCAB)).eval()
    sentences = throughput.newstest_like_sources(5, model.config, 64, seed=0)

    def run(extra: int) -> dict:
        def translate(src: torch.Tensor) -> list:  # fastformer's forced lengths, + extra tokens
            return [[throughput.Best([3] * (int(n) + extra))] for n in (src != 0).sum(dim=1)]

        monkeypatch.setattr(throughput, "translator", lambda *args: translate)
        row, _ = throughput.run_inference("cached-pytorch", model, sentences, [], settings, torch.device("cpu"), 1, 2)
        return row

    assert run(0)["status"] == "ok" and run(0)["tokens_match"]
    mismatch = run(1)
    assert mismatch["status"] == "mismatch" and not mismatch["tokens_match"]
    expected = sum(len(s) + 1 for s in sentences)
    assert f"decoded {expected + 5} target tokens, not the {expected}" in mismatch["error"]


def test_outputs_are_checked_before_a_run_and_default_folders_are_not_reused(tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert bench_utils.output_problem(tmp_path) == "is a folder, not a file"
    assert bench_utils.output_problem(a_file, folder=True) == "is a file, not a folder"
    assert bench_utils.output_problem(a_file / "x" / "out.json") == f"cannot be made: {a_file} is a file"
    assert bench_utils.output_problem(tmp_path / "new" / "deeper" / "out.json") is None
    assert bench_utils.output_problem(tmp_path / "new" / "dir", folder=True) is None
    assert not (tmp_path / "new").exists()  # it only looks

    base = tmp_path / "2026-12-01-cpu"
    assert bench_utils.first_free(base) == base
    for suffix in ("", "-b", "-c"):
        Path(f"{base}{suffix}").mkdir()
    assert bench_utils.first_free(base) == tmp_path / "2026-12-01-cpu-d"
    for letter in "defghijklmnopqrstuvwxyz":
        (tmp_path / f"2026-12-01-cpu-{letter}").mkdir()
    assert bench_utils.first_free(base) == tmp_path / "2026-12-01-cpu-aa"
    monkeypatch.setattr(bench_utils, "RUNS", tmp_path / "runs")
    first = bench_utils.default_out_dir(torch.device("cpu"))
    first.mkdir(parents=True)
    assert bench_utils.default_out_dir(torch.device("cpu")) == first.with_name(first.name + "-b")

    for script, arguments in (("cpu_decoding.py", ["--out", str(tmp_path)]),
                              ("cpu_shortlist.py", ["--out", str(a_file / "out.json")]),
                              ("cpu_options.py", ["--out", str(tmp_path)]),
                              ("throughput.py", ["--device", "cpu", "--out-dir", str(a_file)]),
                              ("kernels.py", ["--device", "cpu", "--out-dir", str(a_file / "sub")])):
        completed = subprocess.run([sys.executable, str(BENCHMARKS / script), *arguments], capture_output=True,
                                   text=True, timeout=300, cwd=BENCHMARKS.parent)
        assert completed.returncode == 2, (script, completed.stdout + completed.stderr)
        assert completed.stderr.strip().splitlines()[-1].startswith(f"{script}: error: --out"), completed.stderr
        assert "Traceback" not in completed.stderr


def _cpu_decoding_arguments(arguments: list[str]) -> object:
    return cpu_decoding.build_parser().parse_args(arguments)


def _throughput_arguments(arguments: list[str]) -> object:
    return throughput.parse_args(["--device", "cpu", *arguments])


@pytest.mark.parametrize("parse, arguments, error", [
    (_cpu_decoding_arguments, ["--rounds", "0"], "argument --rounds: must be at least 1, not 0"),
    (_cpu_decoding_arguments, ["--sentences", "0"], "argument --sentences: must be at least 1, not 0"),
    (_cpu_decoding_arguments, ["--threads", "0"], "argument --threads: must be at least 1, not 0"),
    (_cpu_decoding_arguments, ["--beam", "0"], "argument --beam: must be at least 1, not 0"),
    (_cpu_decoding_arguments, ["--vocab", "0"], "argument --vocab: must be at least 4"),
    (_cpu_decoding_arguments, ["--source-tokens", "1"], "argument --source-tokens: must be at least 2"),
    (_throughput_arguments, ["--sentences", "0"], "argument --sentences: must be at least 1, not 0"),
    (_throughput_arguments, ["--sentences", "-3"], "argument --sentences: must be at least 1, not -3"),
    (_throughput_arguments, ["--batch-sizes", "8,0"], "argument --batch-sizes: must be at least 1, not 0"),
    (_throughput_arguments, ["--infer-repeats", "0"], "argument --infer-repeats: must be at least 1, not 0"),
    (_throughput_arguments, ["--repeats", "0"], "argument --repeats: must be at least 1, not 0")])
def test_cpu_decoding_and_throughput_refuse_numbers_they_cannot_run(parse, arguments, error, capsys):
    with pytest.raises(SystemExit):
        parse(arguments)
    assert error in capsys.readouterr().err


def test_the_other_scripts_refuse_numbers_and_choices_they_cannot_run(monkeypatch, capsys):
    import cpu_shortlist
    import kernels

    with pytest.raises(SystemExit):
        cpu_options.parse_args(["--rounds", "0"])
    assert "argument --rounds: must be at least 1, not 0" in capsys.readouterr().err
    for arguments, error in ((["--rounds", "0"], "argument --rounds: must be at least 1, not 0"),
                             (["--vocab", "102"], "argument --vocab: must be at least 103 (the shortlist always "
                                                  "keeps ids 3-102), not 102")):
        monkeypatch.setattr(sys, "argv", ["cpu_shortlist.py", *arguments])
        with pytest.raises(SystemExit):
            cpu_shortlist.main()
        assert error in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels.main sets it for a CPU run
    with pytest.raises(SystemExit):
        kernels.main(["--device", "cpu", "--ops", ","])
    assert "--ops names no op" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_scale.build_parser().parse_args(["--runs", "first,bogus"])
    assert "argument --runs: choose from first,second,resume,ranks4" in capsys.readouterr().err


def test_prepare_scale_fails_naming_a_failed_run(tmp_path, monkeypatch):
    """Every run is recorded, with the commit as the other benchmarks record it, and a run that failed makes the
    script fail, naming it; --help has the whole docstring."""
    assert prepare_scale.build_parser().description == prepare_scale.__doc__
    corpus = _sources(tmp_path / "corpus", {"train.en": "a\n", "train.de": "b\n"})

    def measured_run(command: list[str], log: Path) -> dict:
        return {"command": " ".join(command), "returncode": 1 if log.stem == "second" else 0, "log": str(log)}

    monkeypatch.setattr(prepare_scale, "measured_run", measured_run)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as failed:
        prepare_scale.main(["--work-dir", str(tmp_path / "work"), "--data-dir", str(corpus), "--runs", "first,second",
                            "--out", str(out)])
    assert str(failed.value) == f"failed: second (exit status 1, log {tmp_path / 'work' / 'second.log'})"
    results = json.loads(out.read_text())
    assert [run["returncode"] for run in results["runs"].values()] == [0, 1]
    assert results["commit"] == bench_utils.git_commit() and results["device"] == bench_utils.cpu_description()
    # The default results folder of the day is not written over: the next free one is taken.
    monkeypatch.setattr(prepare_scale, "REPO", tmp_path)
    taken = bench_utils.first_free(tmp_path / "benchmarks" / "results" /
                                   f"{prepare_scale.datetime.date.today().isoformat()}-{prepare_scale.cpu_slug()}")
    taken.mkdir(parents=True)
    prepare_scale.main(["--work-dir", str(tmp_path / "work"), "--data-dir", str(corpus), "--runs", "first"])
    assert not any(taken.iterdir()) and (taken.with_name(taken.name + "-b") / "prepare_scale.json").is_file()


@pytest.mark.parametrize("runs", ["second", "resume", "ranks4", "second,first"])
def test_prepare_scale_refuses_runs_without_the_first_they_run_on(tmp_path, monkeypatch, capsys, runs):
    """Every invocation deletes the prepared directory and the runs: second, resume or ranks4 without first before
    them would time a fresh preparation or resume nothing, so they are refused, in one line, before anything runs."""
    monkeypatch.setattr(prepare_scale, "measured_run", lambda command, log: pytest.fail("a run started"))
    with pytest.raises(SystemExit):
        prepare_scale.main(["--work-dir", str(tmp_path / "work"), "--runs", runs, "--out", str(tmp_path / "o.json")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: --runs {runs} needs first before the others" in error, error
    assert not (tmp_path / "work").exists()
