"""End-to-end speed: training tokens/s (with peak memory and MFU) and beam-search translation speed, fastformer
against the baselines users would pick.

    python benchmarks/throughput.py                         # on the GPU: base and big, every system
    python benchmarks/throughput.py --device cpu --preset tiny   # the quick smoke run CI does

Training: one update = forward + backward + Adam step over one WMT-like batch, bf16 autocast on CUDA (fp32 on CPU).
Systems: "fastformer" (the model on the fused Triton kernels), "fastformer-captured" (the same, trained as `fastformer
train --precision bf16-master --step captured` trains it: train.captured_training's bf16 compute copy with fp32 master
weights and capturable Adam, each batch shape's step replayed as one CUDA graph by CapturedStep; CUDA only, a CPU run
reports it skipped), "reference" (the model on the plain-PyTorch references, eager), "reference-compile" (that under
torch.compile), "torch-nn" (baselines.TorchTransformer: torch.nn's layers, SDPA, F.cross_entropy), and, on request,
"fastformer-compile".

Fairness: every system trains the very same batches, on the same device. --batching picks them:
  buckets (default): static-shape batches as `fastformer train --batching buckets` makes them (BucketBatchSampler,
    collated by TokenizedCorpus.batch) from a sample of WMT-like lengths (bench_utils.wmt_lengths) large enough to
    fill every bucket (~93% real source and ~91% real target tokens over the sample's epoch); the timed batches are
    the typical batch of each of `batches` equal length slices (bench_utils.wmt_bucket_batches). Static shapes are
    what the captured step needs, and torch.compile gains from them too (one compilation per shape).
  tokens: fairseq's token-budget batches of free shapes, padded to x8 (bench_utils.wmt_batches); the captured system
    cannot run on them and is refused.
Every row counts only real (unpadded) target tokens, and gives the real share of the source and target tokens its
batches hold. All batches are run untimed first (warm-up: `warmup` passes, which compile every shape, and for the
captured system at least CapturedStep.WARMUP_RUNS + 1, so that every shape's graph is captured) before the timed
passes. The captured system is fed CPU batches, which it copies in itself (as training does); the others get their
batches on the device beforehand.

Inference: beam search over newstest-like sources (mean ~27 tokens) on random weights, with EOS barred until each
hypothesis has as many tokens as its source (max_len_a=1, max_len_b=0, min_len=max_positions: forcing EOS wins over
barring it), so fastformer's systems decode exactly sum(source length + 1) target tokens. CTranslate2 and transformers
take one length a call, so they decode every sentence of a batch to its longest source + 1: more tokens, where a
batch's sources differ in length, than fastformer decodes. Such a row did other work: its status is "mismatch" (its
"tokens ok" False), not "ok", and it gets no ratio (splitting the batch by length instead would time the engines on
smaller calls than fastformer's). Systems:
"fastformer"
(model.translate(shrink="buckets"): bucketed rows, on CUDA each bucket's step replayed as a CUDA graph),
"fastformer-every-step" (model.translate(shrink="every_step"), translate's default: the host waits for every step),
"cached-pytorch"
(baselines.cached_beam_search), "reference" (fastformer.reference.beam_search, full recompute, on fewer sentences),
"ctranslate2", "ctranslate2-int8" (one batch on intra-op threads: inter_threads=1, intra_threads=T) and, on the CPU,
"ctranslate2-inter", "ctranslate2-int8-inter" (CTranslate2's throughput mode: inter_threads=T, intra_threads=1,
max_batch_size=ceil(batch / T), the batch's parts translated in parallel), and "transformers", where installed.
Each inference row's "x best CTranslate2" is its rate over the best "ok" CTranslate2 row (either compute type,
either threading mode) at the same batch size. benchmarks/cpu_decoding.py, whose sources all have one length, is the
comparison with CTranslate2.

Model FLOPs of an update (MFU = FLOPs / time / the device's dense bf16 peak), over the real (unpadded) tokens, with
S/T the source/target lengths per sentence, d = d_model, f = d_ff, V = vocab:
    3 x [ L_enc (sum S (8d^2 + 4df) + 4d sum S^2)
        + L_dec (sum T (12d^2 + 4df) + 4d^2 sum S + 2d sum T(T+1) + 4d sum S T) + 2dV sum T ]
i.e. 6 x the non-embedding parameters used per token, plus attention scores/values (causal half counted), plus the
output projection; ~378 MFLOP per target token for base at WMT lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

import bench_utils as bu
import fastformer
from baselines import TorchTransformer, cached_beam_search, ctranslate2_engine, marian_model, placeholder_vocabulary
from fastformer import Transformer, TransformerConfig
from fastformer.decoding.compiled import COMPUTE_TYPES
from fastformer.reference.beam_search import beam_search as reference_beam_search
from fastformer.training.captured_step import WARMUP_RUNS as CAPTURE_WARMUP_RUNS
from fastformer.training.trainer import captured_training

TRAIN_SYSTEMS = ("fastformer", "fastformer-captured", "reference", "reference-compile", "torch-nn",
                 "fastformer-compile")
DEFAULT_TRAIN_SYSTEMS = TRAIN_SYSTEMS[:5]
# The CPU run is a quick smoke run: without the systems that take most of its time (torch.compile's tracing of the
# reference, transformers' Python generate loop), nor those it cannot run, nor fastformer-every-step (a second
# fastformer row, which on the CPU differs only in how the batch shrinks); --systems names them.
CPU_SLOW_SYSTEMS = ("reference-compile", "transformers", "fastformer-every-step")
CUDA_ONLY_SYSTEMS = ("fastformer-captured",)
BATCHINGS = ("buckets", "tokens")
INFER_SYSTEMS = ("fastformer", "fastformer-every-step", "cached-pytorch", "reference", "ctranslate2", "ctranslate2-int8",
                 "ctranslate2-inter", "ctranslate2-int8-inter", "transformers")
CPU_ONLY_SYSTEMS = ("ctranslate2-inter", "ctranslate2-int8-inter")  # inter_threads splits the CPU's threads
PRESETS = ("tiny", "base", "big")
TINY_VOCAB = 1000

# The training targets, for transformer-base on an H100 in bf16.
TARGET_TRAIN_TOKENS_PER_S = 750_000
TARGET_TRAIN_VS_REFERENCE = 1.5
TARGET_TRAIN_VS_COMPILED = 1.15
# The inference targets.
TARGET_INFER_VS_CACHED = 3.0
TARGET_INFER_VS_REFERENCE = 10.0
TARGET_INFER_TOKENS_PER_S = 100_000  # beam 4, fp16, 256 sentences a batch (issue 12)


@dataclass
class Settings:
    device: str
    presets: list[str]
    train_systems: list[str]
    infer_systems: list[str]
    max_tokens: int | None  # None: 25k for base/big, 256 for tiny
    batching: str  # one of BATCHINGS
    batches: int
    warmup: int
    repeats: int
    compile_backend: str
    compile_mode: str
    sentences: int
    batch_sizes: list[int]
    source_len: int | None
    reference_sentences: int
    latency_sentences: int
    beam_size: int
    length_penalty: float
    infer_dtype: str
    infer_compute_type: str | None  # fastformer's translate(compute_type=...); None: infer_dtype
    infer_repeats: int
    seed: int
    time_budget_s: float | None
    peak_tflops: float | None
    notes: list[str] = field(default_factory=list)


def model_config(preset: str) -> TransformerConfig:
    if preset == "tiny":
        return TransformerConfig.tiny(TINY_VOCAB)
    return getattr(TransformerConfig, preset)(bu.WMT_VOCAB)


def default_max_tokens(preset: str) -> int:
    return 256 if preset == "tiny" else 25_000


def max_sentence_len(preset: str) -> int:
    """Longest sentence the synthetic data holds: WMT's usual 128-token filter (64 for the tiny smoke model)."""
    return 64 if preset == "tiny" else 128


def training_flops(config: TransformerConfig, src_lengths: torch.Tensor, tgt_lengths: torch.Tensor) -> float:
    """Model FLOPs of forward + backward over real tokens; src_lengths with EOS, tgt_lengths of tgt_in (module doc)."""
    d, f, vocab = config.d_model, config.d_ff, config.vocab_size
    s, t = src_lengths.double(), tgt_lengths.double()
    encoder = config.n_encoder_layers * (s.sum() * (8 * d * d + 4 * d * f) + 4 * d * (s * s).sum())
    decoder = config.n_decoder_layers * (t.sum() * (12 * d * d + 4 * d * f) + 4 * d * d * s.sum()
                                         + 2 * d * (t * (t + 1)).sum() + 4 * d * (s * t).sum())
    output = 2 * d * vocab * t.sum()
    return float(3 * (encoder + decoder + output))


# ---------------------------------------------------------------------------------------------------------------------
# Training


def build_update(system: str, config: TransformerConfig, device: torch.device, compile_backend: str,
                 compile_mode: str) -> tuple[Callable[[bu.Batch], None], str]:
    """-> (one full update on a batch, the fastformer backend it runs under)."""
    torch.manual_seed(0)
    if system == "fastformer-captured":
        return captured_update(config, device), "triton"
    if system == "torch-nn":
        model: torch.nn.Module = TorchTransformer(config).to(device)
        backend = "reference"  # unused by torch.nn's layers
    else:
        model = Transformer(config).to(device)
        backend = "triton" if system.startswith("fastformer") else "reference"
    model.train()

    def loss(src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, src_lengths: torch.Tensor,
             tgt_lengths: torch.Tensor) -> torch.Tensor:
        if system == "torch-nn":
            return model.loss(src, tgt_in, tgt_out, label_smoothing=0.1, reduction="sum")
        # The lengths as `fastformer train` passes them: checked while batching, so the step has no host sync.
        return model.loss(src, tgt_in, tgt_out, label_smoothing=0.1, reduction="sum",
                          lengths=(src_lengths, tgt_lengths))

    if system.endswith("-compile"):
        # "reduce-overhead" replays the compiled step as CUDA graphs, which only a step free of host syncs allows.
        loss = torch.compile(loss, backend=compile_backend, mode=None if compile_mode == "default" else compile_mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                 fused=device.type == "cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def update(batch: bu.Batch) -> None:
        with autocast:
            value = loss(batch.src, batch.tgt_in, batch.tgt_out, batch.src_lengths, batch.tgt_lengths)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return update, backend


def captured_update(config: TransformerConfig, device: torch.device) -> Callable[[bu.Batch], None]:
    """-> one update of `fastformer train --precision bf16-master --step captured` on a CPU batch of a bucket's shape:
    the step's graph of that shape (forward, backward, gradients into the fp32 masters), then the update's graph
    (gradients scaled to the mean over the batch's target tokens, Adam, the bf16 copy refreshed)."""
    step = captured_training(Transformer(config).to(device), label_smoothing=0.1, lr=1e-4, device=device)

    def update(batch: bu.Batch) -> None:
        step.micro_step(batch.training_batch())
        step.update(grad_scale=1.0 / max(batch.target_tokens, 1))

    return update


def real_token_ratios(batches: list[bu.Batch]) -> dict:
    """-> the real (unpadded) share of the source and target tokens the batches hold, padding included."""
    real_src = sum(int(batch.real_src_lengths.sum()) for batch in batches)
    real_tgt = sum(batch.target_tokens for batch in batches)
    return {"source": real_src / sum(batch.src.numel() for batch in batches),
            "target": real_tgt / sum(batch.tgt_out.numel() for batch in batches)}


def run_training(system: str, config: TransformerConfig, batches: list[bu.Batch], settings: Settings,
                 device: torch.device) -> dict:
    """Times `repeats` passes over the batches after `warmup` untimed ones -> the row of the results."""
    update, backend = build_update(system, config, device, settings.compile_backend, settings.compile_mode)
    with fastformer.backend(backend), warnings.catch_warnings(record=True) as caught:
        # Every fallback warning, not only the first of the process, so that this system reports its own.
        warnings.simplefilter("always")

        def one_pass() -> None:
            for batch in batches:
                update(batch)

        # A captured step runs each shape eagerly CAPTURE_WARMUP_RUNS times, then captures it on the next run.
        warmup = max(settings.warmup, CAPTURE_WARMUP_RUNS + 1) if system == "fastformer-captured" else settings.warmup
        for _ in range(warmup):
            one_pass()
        bu.reset_peak_memory(device)
        times = bu.time_calls(one_pass, device, warmup=0, repeats=settings.repeats)
        peak = bu.peak_memory(device)
    tokens = sum(batch.target_tokens for batch in batches)
    flops = sum(training_flops(config, batch.real_src_lengths, batch.real_tgt_lengths) for batch in batches)
    tokens_per_s = bu.summary([tokens / t for t in times])
    peak_tflops = settings.peak_tflops or (bu.bf16_peak_tflops(bu.device_name(device)) if device.type == "cuda"
                                           else None)
    fallbacks = sorted({str(w.message) for w in caught if "falls back to the reference" in str(w.message)})
    return {
        "tokens_per_s": tokens_per_s,
        "seconds_per_update": bu.summary([t / len(batches) for t in times]),
        "target_tokens_per_update": tokens / len(batches),
        "real_token_ratio": real_token_ratios(batches),
        "peak_memory_gib": None if peak is None else peak / 2**30,
        "model_flops_per_target_token": flops / tokens,
        "tflops": flops / statistics.median(times) / 1e12,
        "mfu": None if peak_tflops is None else flops / statistics.median(times) / (peak_tflops * 1e12),
        "notes": fallbacks,
    }


def training_section(presets: list[str], settings: Settings, device: torch.device, record: Recorder) -> None:
    for preset in presets:
        max_tokens = settings.max_tokens or default_max_tokens(preset)
        for system in settings.train_systems:
            record("training", {"preset": preset, "system": system, "batching": settings.batching,
                                "runs": runs_on(system, "train", device)},
                   lambda: measure_training_with_fallback(system, preset, max_tokens, settings, device))


def measure_training_with_fallback(system: str, preset: str, max_tokens: int, settings: Settings,
                                   device: torch.device) -> dict:
    """Runs at max_tokens, halving it on out-of-memory ("or the largest that fits"); failures become the row, and a
    system this device cannot run a "skipped" row saying why."""
    if system in CUDA_ONLY_SYSTEMS and device.type != "cuda":
        return {"status": "skipped", "error": f"not runnable on {device.type}: CUDA only (it replays CUDA graphs, "
                                              f"fastformer.training.captured_step)"}
    config = model_config(preset)
    make_batches = bu.wmt_bucket_batches if settings.batching == "buckets" else bu.wmt_batches
    while True:
        batches = make_batches(settings.batches, max_tokens, config.vocab_size, max_sentence_len(preset),
                               seed=settings.seed)
        # The captured step copies each CPU batch in itself, from pinned memory, as training does.
        batches = batches if system == "fastformer-captured" else [batch.to(device) for batch in batches]
        try:
            row = run_training(system, config, batches, settings, device)
            return {"status": "ok", "max_tokens": max_tokens, **row}
        except torch.cuda.OutOfMemoryError:
            if max_tokens <= 1024:
                return {"status": "error", "error": "out of memory even at 1024 tokens"}
            max_tokens //= 2
        except Exception as error:  # noqa: BLE001 - a failing system is reported, the others still run
            return {"status": "error", "error": f"{type(error).__name__}: {error}"[:500]}
        finally:
            del batches
            if system.endswith("-compile"):
                torch._dynamo.reset()
            bu.free_memory(device)


def describe(row: dict) -> str:
    """One progress line: the result (or why there is none) and the wall time it took, warm-up included."""
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('error', '')} [{row['wall_s']:.0f} s]"
    stats = row["tokens_per_s"]
    return f"{stats['median']:,.0f} tok/s (spread {bu.spread_percent(stats):.1f}%) [{row['wall_s']:.0f} s]"


# ---------------------------------------------------------------------------------------------------------------------
# Inference


def newstest_like_sources(n: int, config: TransformerConfig, max_len: int, seed: int,
                          source_len: int | None = None) -> list[torch.Tensor]:
    """n source sentences (ids with a final EOS), lengths like newstest's (mean ~27), or all source_len tokens plus
    EOS."""
    generator = torch.Generator().manual_seed(seed + 1)
    src_lengths, _ = bu.wmt_lengths(n, generator, max_len)
    if source_len is not None:
        src_lengths = torch.full((n,), source_len + 1)
    sentences = []
    for length in src_lengths.tolist():
        ids = torch.randint(3, config.vocab_size, (length,), generator=generator)
        ids[-1] = config.eos_id
        sentences.append(ids)
    return sentences


def length_sorted_batches(sentences: list[torch.Tensor], batch_size: int, pad_id: int,
                          device: torch.device) -> list[torch.Tensor]:
    """Sentences sorted by length (as translation tools do), in right-padded [batch, src_len] batches."""
    ordered = sorted(sentences, key=len)
    return [torch.nn.utils.rnn.pad_sequence(ordered[i:i + batch_size], batch_first=True,
                                            padding_value=pad_id).to(device)
            for i in range(0, len(ordered), batch_size)]


def translator(system: str, model: Transformer, settings: Settings) -> Callable[[torch.Tensor], list]:
    """-> src batch -> best hypotheses, for one system, decoding exactly the source length (module doc)."""
    options = dict(beam_size=settings.beam_size, length_penalty=settings.length_penalty, max_len_a=1.0,
                   max_len_b=0, min_len=model.config.max_positions, n_best=1)
    compute_type = settings.infer_compute_type
    if system == "fastformer":  # by name: "auto" stays every_step until buckets pass the GPU tests on a GPU
        return lambda src: model.translate(src, shrink="buckets", compute_type=compute_type, **options)
    if system == "fastformer-every-step":  # the host waits for every step
        return lambda src: model.translate(src, shrink="every_step", compute_type=compute_type, **options)
    if system == "cached-pytorch":
        return lambda src: cached_beam_search(model, src, **options)
    if system.startswith("ctranslate2"):
        return ctranslate2_translator(model, settings, quantization="int8" if "-int8" in system else "float32",
                                      inter=system.endswith("-inter"))
    if system == "transformers":
        return transformers_translator(model, settings)

    def reference(src: torch.Tensor) -> list:
        with fastformer.backend("reference"):
            return reference_beam_search(model, src, **options)

    return reference


class Best(NamedTuple):
    tokens: list[int]


def source_pieces(src: torch.Tensor, config: TransformerConfig, vocabulary: list[str]) -> list[list[str]]:
    """[batch, src_len] right-padded ids ending in EOS -> token strings without padding and EOS (CTranslate2 adds
    EOS itself)."""
    return [[vocabulary[i] for i in row if i != config.pad_id][:-1] for row in src.tolist()]


def ctranslate2_translator(model: Transformer, settings: Settings, quantization: str,
                           inter: bool) -> Callable[[torch.Tensor], list]:
    """CTranslate2 on the exported weights, decoding as many steps as fastformer's forced length (the batch's
    longest source with EOS): EOS is barred until then by min_decoding_length and the cut is max_decoding_length.
    inter: the CPU's threads translate parts of the batch in parallel (module docstring)."""
    vocabulary = placeholder_vocabulary(model.config)
    device = "cuda" if settings.device.startswith("cuda") else "cpu"
    threads = torch.get_num_threads()
    engine = ctranslate2_engine(model, vocabulary, quantization, device=device, inter_threads=threads if inter else 1,
                                intra_threads=0 if device != "cpu" else 1 if inter else threads)
    index = {token: i for i, token in enumerate(vocabulary)}

    def translate(src: torch.Tensor) -> list:
        steps = int((src != model.config.pad_id).sum(dim=1).max()) + 1  # + fastformer's forced EOS step
        results = engine.translate_batch(source_pieces(src, model.config, vocabulary), beam_size=settings.beam_size,
                                         length_penalty=settings.length_penalty, min_decoding_length=steps,
                                         max_decoding_length=steps,
                                         max_batch_size=math.ceil(len(src) / threads) if inter else 0)
        return [[Best([index[p] for p in result.hypotheses[0]])] for result in results]

    return translate


def transformers_translator(model: Transformer, settings: Settings) -> Callable[[torch.Tensor], list]:
    """MarianMTModel.generate on fastformer's weights, decoding as many steps as fastformer's forced length (the
    batch's longest source with EOS)."""
    marian, why_not = marian_model(model.float().cpu())
    model.to(dtype=getattr(torch, settings.infer_dtype), device=settings.device)
    if marian is None:
        raise NotImplementedError(f"transformers: {why_not}")
    marian = marian.to(device=settings.device, dtype=getattr(torch, settings.infer_dtype))
    config = model.config

    def translate(src: torch.Tensor) -> list:
        steps = int((src != config.pad_id).sum(dim=1).max()) + 1  # + fastformer's forced EOS step
        with torch.no_grad():
            output = marian.generate(input_ids=src, attention_mask=(src != config.pad_id).long(),
                                     num_beams=settings.beam_size, length_penalty=settings.length_penalty,
                                     min_new_tokens=steps, max_new_tokens=steps, do_sample=False)
        return [[Best([i for i in row[1:] if i not in (config.pad_id, config.eos_id)])] for row in output.tolist()]

    return translate


def run_inference(system: str, model: Transformer, sentences: list[torch.Tensor], latency_sentences: list[torch.Tensor],
                  settings: Settings, device: torch.device, repeats: int,
                  batch_size: int) -> tuple[dict, list[list[int]]]:
    """-> (the row of the results, the best hypothesis' tokens per sentence in length-sorted order)."""
    translate = translator(system, model, settings)
    batches = length_sorted_batches(sentences, batch_size, model.config.pad_id, device)
    outputs: list[list[int]] = []

    def one_pass() -> None:
        outputs.clear()
        for src in batches:
            outputs.extend(hypotheses[0].tokens for hypotheses in translate(src))

    # The reference is slow: its warm-up is one batch, not a pass.
    if system == "reference":
        translate(batches[0][:1])
    else:
        one_pass()
    times = bu.time_calls(one_pass, device, warmup=0, repeats=repeats)
    expected_tokens = sum(len(s) + 1 for s in sentences)
    # fastformer's searches end with the forced EOS, the engines with the cut at the same step (no EOS).
    ends_with_cut = system.startswith("ctranslate2") or system == "transformers"
    decoded_tokens = sum(len(tokens) + (0 if ends_with_cut else 1) for tokens in outputs)
    latency = []
    for sentence in latency_sentences:
        latency += bu.time_calls(lambda: translate(sentence[None].to(device)), device, warmup=1, repeats=1)
    row = {
        "status": "ok" if decoded_tokens == expected_tokens else "mismatch",
        "sentences": len(sentences),
        "batch_size": batch_size,
        "target_tokens": decoded_tokens,
        "tokens_match": decoded_tokens == expected_tokens,
        "tokens_per_s": bu.summary([decoded_tokens / t for t in times]),
        "sentences_per_s": bu.summary([len(sentences) / t for t in times]),
        "latency_ms": bu.summary([1000 * t for t in latency]) if latency else None,
    }
    if row["status"] == "mismatch":
        # Not the same work as the other systems: its rate is no comparison (tables and targets take "ok" rows).
        row["error"] = f"decoded {decoded_tokens} target tokens, not the {expected_tokens} of the forced lengths"
    return row, list(outputs)


def inference_section(settings: Settings, device: torch.device, record: Recorder) -> None:
    preset = "tiny" if "tiny" in settings.presets else "base"
    config = model_config(preset)
    torch.manual_seed(0)
    dtype = getattr(torch, settings.infer_dtype)
    model = Transformer(config).to(device=device, dtype=dtype).eval()
    sentences = newstest_like_sources(settings.sentences, config, max_sentence_len(preset), settings.seed,
                                      settings.source_len)
    # Single-sentence latency on sentences of typical length.
    typical = sorted(sentences, key=lambda s: abs(len(s) - bu.WMT_MEAN_TARGET_LEN))[:settings.latency_sentences]
    fastformer_outputs: dict[int, list[list[int]]] = {}
    for batch_size in settings.batch_sizes:
        for system in settings.infer_systems:
            slow = system == "reference"
            subset = sentences[:settings.reference_sentences] if slow else sentences

            def measure() -> dict:
                row, outputs = run_inference(system, model, subset, typical[:2] if slow else typical, settings,
                                             device, 1 if slow else settings.infer_repeats, batch_size)
                if system == "fastformer":
                    fastformer_outputs[batch_size] = outputs
                elif batch_size in fastformer_outputs and not slow:
                    reference = fastformer_outputs[batch_size]
                    row["same_tokens_as_fastformer"] = sum(a == b for a, b in zip(outputs, reference)) / len(outputs)
                return row

            compute_type = settings.infer_compute_type if system.startswith("fastformer") else None
            record("inference", {"preset": preset, "system": system, "dtype": settings.infer_dtype,
                                 "compute_type": compute_type, "runs": runs_on(system, "infer", device)}, measure)
    del model
    bu.free_memory(device)


def runs_on(system: str, section: str, device: torch.device) -> str:
    """What a system really executes on this device (on a CPU, "fastformer" training is Triton's interpreter)."""
    cpu = device.type == "cpu"
    if system.startswith("fastformer"):
        if section == "infer":
            return "C++ beam search, CPU ops" if cpu else "C++ beam search, CUDA kernels"
        if system == "fastformer-captured":
            return "not on CPU (CUDA graphs)" if cpu else "Triton kernels, bf16 + fp32 masters, CUDA graphs"
        return "Triton interpreter (not a speed figure)" if cpu else "Triton kernels"
    if system.startswith("ctranslate2"):
        threading = "inter_threads" if system.endswith("-inter") else "intra_threads"
        return f"CTranslate2 {'int8' if '-int8' in system else 'fp32'} on {device.type}, {threading}"
    return {"transformers": "MarianMTModel.generate", "torch-nn": "torch.nn layers + SDPA",
            "cached-pytorch": "PyTorch KV-cache loop", "reference": "plain PyTorch, no cache" if section == "infer"
            else "plain PyTorch"}.get(system, "plain PyTorch (torch.compile)" if system.endswith("-compile") else "")


# Packages of the peers measured beside fastformer, which a machine may lack.
OPTIONAL_PEERS = ("ctranslate2", "transformers")


class Recorder:
    """Runs one measurement into a row of the results (or a "skipped"/"error" row), saves the JSON, prints a line."""

    def __init__(self, results: dict, settings: Settings, save: Callable[[], None]) -> None:
        self.results, self.settings, self.save = results, settings, save
        self.started = time.monotonic()

    def __call__(self, section: str, row: dict, measure: Callable[[], dict]) -> None:
        label = f"{section[:5]} {row['preset']:5s} {row['system']:18s}"
        print(f"  {label} ({row['runs']}) ...", flush=True)
        started = time.monotonic()
        budget = self.settings.time_budget_s
        if budget is not None and started - self.started >= budget:
            row.update(status="skipped", error="time budget spent")
        else:
            try:
                row.update(measure())
            except Exception as error:  # noqa: BLE001 - a failing system is reported, the others still run
                if isinstance(error, ModuleNotFoundError) and error.name in OPTIONAL_PEERS:
                    # A peer that is not installed (the GPU machine has no CTranslate2) is no failure of the run.
                    row.update(status="skipped", error=f"not installed: {error.name}")
                else:
                    row.update(status="error", error=f"{type(error).__name__}: {error}"[:500])
        row["wall_s"] = time.monotonic() - started
        self.results[section].append(row)
        self.save()
        print(f"  {label} {describe(row)}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Targets, tables, chart


def find(rows: list[dict], **keys) -> dict | None:
    for row in rows:
        if all(row.get(k) == v for k, v in keys.items()) and row.get("status") == "ok":
            return row
    return None


def median_of(row: dict | None, metric: str = "tokens_per_s") -> float | None:
    return None if row is None else row[metric]["median"]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(results: dict) -> list[dict]:
    """The training and inference targets (transformer-base) against what was measured."""
    train, infer = results["training"], results["inference"]
    # The training targets hold for the fastest fastformer system (eager, captured or compiled).
    measured = [row for row in (find(train, preset="base", system=system) for system in TRAIN_SYSTEMS
                                if system.startswith("fastformer")) if row is not None]
    best = max(measured, key=median_of, default=None)
    fused = median_of(best)
    reference = median_of(find(train, preset="base", system="reference"))
    compiled = median_of(find(train, preset="base", system="reference-compile"))
    translate = median_of(find(infer, preset="base", system="fastformer"))
    cached = median_of(find(infer, preset="base", system="cached-pytorch"))
    reference_infer = median_of(find(infer, preset="base", system="reference"))
    translate_256 = median_of(find(infer, preset="base", system="fastformer", batch_size=256))
    trained_by = None if best is None else best["system"]
    checks = [
        ("training tokens/s, base", trained_by, fused, TARGET_TRAIN_TOKENS_PER_S),
        ("training speedup vs reference (eager)", trained_by, ratio(fused, reference), TARGET_TRAIN_VS_REFERENCE),
        ("training speedup vs reference (torch.compile)", trained_by, ratio(fused, compiled),
         TARGET_TRAIN_VS_COMPILED),
        ("beam-4 tokens/s vs cached PyTorch decoder", "fastformer", ratio(translate, cached), TARGET_INFER_VS_CACHED),
        ("beam-4 tokens/s vs reference beam search", "fastformer", ratio(translate, reference_infer),
         TARGET_INFER_VS_REFERENCE),
        ("beam-4 tokens/s, base, 256 sentences a batch", "fastformer", translate_256, TARGET_INFER_TOKENS_PER_S),
    ]
    return [{"target": name, "system": system, "measured": value, "goal": goal, "verdict": bu.verdict(value, goal)}
            for name, system, value, goal in checks]


def tables(results: dict) -> str:
    train_rows = []
    for row in results["training"]:
        base = find(results["training"], preset=row["preset"], system="reference")
        train_rows.append({
            **row, "tok_s": median_of(row) if row["status"] == "ok" else None,
            "spread": bu.spread_percent(row["tokens_per_s"]) if row["status"] == "ok" else None,
            "vs_ref": ratio(median_of(row), median_of(base)) if row["status"] == "ok" else None,
            "mfu_pct": None if row.get("mfu") is None else 100 * row["mfu"],
            "mflop_tok": row["model_flops_per_target_token"] / 1e6 if row["status"] == "ok" else None,
            "real_share": ("{source:.2f} / {target:.2f}".format(**row["real_token_ratio"]) if row["status"] == "ok"
                           else None),
            "status_note": (f"{row['status']}: {row.get('error', '')[:60]}" if row["status"] != "ok"
                            else f"ok, BUT {len(row['notes'])} op(s) fell back to the reference (JSON notes)"
                            if row.get("notes") else "ok"),
        })
    infer_rows = []
    for row in results["inference"]:
        ok = row["status"] == "ok"
        cached = find(results["inference"], preset=row["preset"], system="cached-pytorch",
                      batch_size=row.get("batch_size"))
        peers = [median_of(peer) for peer in results["inference"]
                 if peer["system"].startswith("ctranslate2") and peer["status"] == "ok"
                 and (peer["preset"], peer.get("batch_size")) == (row["preset"], row.get("batch_size"))]
        infer_rows.append({
            **row, "tok_s": median_of(row) if ok else None,
            "spread": bu.spread_percent(row["tokens_per_s"]) if ok else None,
            "sent_s": median_of(row, "sentences_per_s") if ok else None,
            "latency": row["latency_ms"]["median"] if ok and row.get("latency_ms") else None,
            "vs_cached": ratio(median_of(row), median_of(cached)) if ok else None,
            "vs_ctranslate2": ratio(median_of(row), max(peers)) if ok and peers else None,
            "same": row.get("same_tokens_as_fastformer"),
            "status_note": row["status"] if ok else f"{row['status']}: {row.get('error', '')[:60]}",
        })
    parts = [
        "Training (real target tokens/s of a full update)",
        bu.format_table(train_rows, [("preset", "preset"), ("system", "system"), ("runs", "runs"),
                                     ("batching", "batches"), ("tok_s", "tokens/s"),
                                     ("spread", "spread %"), ("vs_ref", "x reference"), ("peak_memory_gib", "peak GiB"),
                                     ("mfu_pct", "MFU %"), ("mflop_tok", "MFLOP/tok"),
                                     ("real_share", "real src / tgt"), ("max_tokens", "max_tokens"),
                                     ("status_note", "status")]),
        "",
        "Inference (beam search, forced output length = source length)",
        bu.format_table(infer_rows, [("preset", "preset"), ("system", "system"), ("runs", "runs"),
                                     ("compute_type", "compute type"), ("batch_size", "batch"),
                                     ("sentences", "sentences"), ("tok_s", "tokens/s"), ("spread", "spread %"),
                                     ("sent_s", "sentences/s"), ("latency", "latency ms"), ("vs_cached", "x cached"),
                                     ("vs_ctranslate2", "x best CTranslate2"),
                                     ("same", "same as fastformer"), ("tokens_match", "tokens ok"),
                                     ("status_note", "status")]),
        "",
        "Targets (transformer-base on an H100, bf16)",
        bu.format_table(results["targets"], [("target", "target"), ("system", "fastformer system"),
                                             ("measured", "measured"), ("goal", "goal"), ("verdict", "verdict")]),
    ]
    return "\n".join(parts)


def plot(results: dict, path: Path) -> None:
    """One bar chart per training preset and one for inference; error bars span min..max of the repeats."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"training, {p}", [r for r in results["training"] if r["preset"] == p and r["status"] == "ok"])
              for p in dict.fromkeys(r["preset"] for r in results["training"])]
    panels += [(f"beam-{results['settings']['beam_size']} inference",
                [r for r in results["inference"] if r["status"] == "ok"])]
    panels = [(title, rows) for title, rows in panels if rows]
    figure, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4), squeeze=False)
    for axis, (title, rows) in zip(axes[0], panels):
        medians = [r["tokens_per_s"]["median"] for r in rows]
        errors = [[m - r["tokens_per_s"]["min"] for m, r in zip(medians, rows)],
                  [r["tokens_per_s"]["max"] - m for m, r in zip(medians, rows)]]
        bars = axis.bar([r["system"] for r in rows], medians, yerr=errors, capsize=4,
                        color=["tab:red" if r["system"].startswith("fastformer") else "tab:gray" for r in rows])
        for bar, row in zip(bars, rows):
            label = f"{bar.get_height():,.0f}"
            if row.get("mfu") is not None:
                label += f"\n{100 * row['mfu']:.0f}% MFU"
            axis.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                          fontsize=8)
        axis.set_title(title)
        axis.set_ylabel("target tokens / s")
        if title.endswith("inference"):
            axis.set_yscale("log")  # the full-recompute reference is orders of magnitude slower
        axis.tick_params(axis="x", labelrotation=20)
    environment = results["environment"]
    # Two lines, so that a one-panel chart does not clip the title.
    figure.suptitle(f"fastformer throughput: {environment['device']}\ntorch {environment['torch']}, "
                    f"{environment['date'][:10]}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------------------------------
# Command line


# Defaults of the sizing flags in the three modes: a full GPU run, --quick, and a CPU smoke run (fast: < 1 minute).
MODE_DEFAULTS = {
    "batches": (6, 3, 1),
    "repeats": (5, 3, 1),
    "warmup": (1, 1, 0),
    "max_tokens": (None, None, 128),
    "sentences": (1024, 256, 8),
    "reference_sentences": (32, 16, 2),
    "latency_sentences": (8, 4, 1),
    "infer_repeats": (3, 2, 1),
    "batch_sizes": ([1, 32, 256], [1, 32, 256], [8]),
}


def parse_args(argv: list[str] | None = None) -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--preset", nargs="+", choices=PRESETS, help="default: base big on CUDA, tiny on CPU")
    add("--train", action="store_true", help="run the training section (default: both sections)")
    add("--infer", action="store_true", help="run the inference section (default: both sections)")
    add("--systems", help=f"comma-separated subset of {TRAIN_SYSTEMS + INFER_SYSTEMS[1:]}; default: "
                          f"{','.join(DEFAULT_TRAIN_SYSTEMS)} and every inference system (on CPU without "
                          f"{', '.join(CPU_SLOW_SYSTEMS)})")
    add("--quick", action="store_true", help="fewer batches, repeats and sentences; training on base only")
    sizes = ", ".join(f"{name.replace('_', '-')} {values}" for name, values in MODE_DEFAULTS.items())
    parser.epilog = f"Defaults (full run, --quick, CPU): {sizes}."
    add("--max-tokens", type=bu.positive_int, help="token budget of a training batch (GPU default 25000; 256 for tiny)")
    add("--batching", choices=BATCHINGS, default="buckets",
        help="training batches, the same for every system: static-shape buckets (what fastformer-captured needs) "
             "or fairseq's token-budget batches of free shapes")
    add("--batches", type=bu.positive_int, help="distinct training batches per pass")
    add("--warmup", type=bu.non_negative_int, help="untimed training passes (0 times compilation too: smoke runs only)")
    add("--repeats", type=bu.positive_int, help="timed training passes")
    add("--compile-backend", help="torch.compile backend (default inductor on CUDA, aot_eager on CPU)")
    add("--compile-mode", default="default",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        help="torch.compile mode of the *-compile systems (inductor only); reduce-overhead: CUDA graphs")
    add("--sentences", type=bu.positive_int, help="sentences to translate")
    add("--source-len", type=bu.positive_int,
        help="every source this many tokens plus EOS (default: newstest-like lengths)")
    add("--batch-sizes", type=lambda text: [bu.positive_int(n) for n in text.split(",")],
        help="sentences per translation call, comma-separated; one row per size")
    add("--reference-sentences", type=bu.positive_int, help="sentences for the slow reference")
    add("--latency-sentences", type=bu.non_negative_int, help="sentences timed one at a time")
    add("--beam", type=bu.positive_int, default=4)
    add("--length-penalty", type=float, default=0.6)
    add("--infer-dtype", choices=("float32", "float16", "bfloat16"),
        help="dtype of the translating model (default float16 on CUDA, float32 on CPU)")
    add("--compute-type", choices=COMPUTE_TYPES,
        help="fastformer's translate(compute_type=...): its linear layers in float32, bfloat16 or int8 on the CPU, "
             "float16 or bfloat16 on CUDA, or auto (default: --infer-dtype). benchmarks/cpu_decoding.py sets every "
             "CPU compute type of fastformer and CTranslate2 side by side")
    add("--infer-repeats", type=bu.positive_int, help="timed passes over the sentences")
    add("--seed", type=int, default=0)
    add("--time-budget-s", type=float, help="skip (and report as skipped) what would start after this many seconds")
    add("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from its name)")
    add("--out-dir", type=Path, help="where the JSON and chart go (default runs/benchmarks/<date>-<device>/, "
                                     "which git ignores, or -b, -c, ... after it where an earlier run has it)")
    args = parser.parse_args(argv)
    if args.out_dir:
        bu.check_output(parser, "--out-dir", args.out_dir, folder=True)

    cpu = args.device == "cpu"
    mode = 2 if cpu else 1 if args.quick else 0
    sizing = {name: values[mode] if getattr(args, name) is None else getattr(args, name)
              for name, values in MODE_DEFAULTS.items()}
    chosen = None if args.systems is None else [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(chosen or []) - set(TRAIN_SYSTEMS + INFER_SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {TRAIN_SYSTEMS + INFER_SYSTEMS[1:]}")
    if args.batching != "buckets" and set(chosen or []) & set(CUDA_ONLY_SYSTEMS):
        parser.error(f"fastformer-captured replays one CUDA graph per batch shape: it needs --batching buckets, not "
                     f"--batching {args.batching}")
    compile_backend = args.compile_backend or ("aot_eager" if cpu else "inductor")
    if args.compile_mode != "default" and compile_backend != "inductor":
        parser.error(f"--compile-mode {args.compile_mode} needs the inductor backend, not {compile_backend}")
    both = not args.train and not args.infer
    if chosen is None and cpu:
        chosen = [s for s in dict.fromkeys(INFER_SYSTEMS + DEFAULT_TRAIN_SYSTEMS)
                  if s not in CPU_SLOW_SYSTEMS + CUDA_ONLY_SYSTEMS]
    settings = Settings(
        device=args.device, presets=args.preset or (["tiny"] if cpu else ["base"] if args.quick else ["base", "big"]),
        train_systems=[s for s in chosen or DEFAULT_TRAIN_SYSTEMS if s in TRAIN_SYSTEMS] if args.train or both else [],
        infer_systems=[s for s in chosen or INFER_SYSTEMS if s in INFER_SYSTEMS and (cpu or s not in CPU_ONLY_SYSTEMS)]
        if args.infer or both else [],
        batching=args.batching, compile_backend=compile_backend, compile_mode=args.compile_mode,
        source_len=args.source_len,
        beam_size=args.beam, length_penalty=args.length_penalty,
        infer_dtype=args.infer_dtype or ("float32" if cpu else "float16"), infer_compute_type=args.compute_type,
        seed=args.seed,
        time_budget_s=args.time_budget_s, peak_tflops=args.peak_tflops, **sizing,
    )
    return settings, args.out_dir or bu.default_out_dir(torch.device(args.device))


def main(argv: list[str] | None = None) -> int:
    settings, out_dir = parse_args(argv)
    device = torch.device(settings.device)
    if device.type == "cpu" and "fastformer" in settings.train_systems:
        # Triton runs on CPU tensors only in its interpreter, chosen when the kernels are defined (imported).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        settings.notes.append("CPU: fastformer's training runs its kernels in Triton's interpreter, which says "
                              "nothing of their speed; its translation runs the compiled C++ beam search")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": "throughput", "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
               "environment": bu.environment(device), "settings": asdict(settings),
               "flops_formula": __doc__[__doc__.index("Model FLOPs"):].strip(),
               "training": [], "inference": [], "targets": []}

    def save() -> None:
        results["targets"] = targets(results)
        bu.write_json(out_dir / "throughput.json", results)

    print(f"throughput on {results['environment']['device']} (torch {torch.__version__}, "
          f"commit {results['environment']['commit']}) -> {out_dir}", flush=True)
    for note in settings.notes:
        print(f"note: {note}")
    record = Recorder(results, settings, save)
    interrupted = False
    try:
        # The first preset's training, then inference, then the other presets: under a time budget, big is cut.
        if settings.train_systems:
            training_section(settings.presets[:1], settings, device, record)
        if settings.infer_systems:
            inference_section(settings, device, record)
        if settings.train_systems:
            training_section(settings.presets[1:], settings, device, record)
    except KeyboardInterrupt:
        # A time limit's SIGINT: report what was measured.
        interrupted = True
        results["interrupted"] = True
        print("\ninterrupted: reporting what was measured", flush=True)
    save()
    print()
    print(tables(results))
    plot(results, out_dir / "throughput.png")
    print(f"\nwrote {out_dir / 'throughput.json'} and {out_dir / 'throughput.png'}")
    rows = results["training"] + results["inference"]
    failed = [r for r in rows if r["status"] == "error"]
    if not any(r["status"] == "ok" for r in rows):
        print("nothing was measured", file=sys.stderr)
        return 1
    return 1 if failed or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
