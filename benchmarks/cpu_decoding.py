"""CPU beam-search decoding in every compute type: fastformer against CTranslate2 on the same random weights.

    OMP_NUM_THREADS=2 python benchmarks/cpu_decoding.py --shape b --vocab 37000 --rounds 3

Shapes: "a" is the tiny preset (d_model 64, 2 + 2 layers), "b" the paper's base model (d_model 512, 6 + 6 layers,
d_ff 2048, 8 heads); --vocab sets the shared vocabulary (WMT14's is 37,000). Each batch is N sentences of 20 source
tokens plus EOS, beam 4, and every hypothesis is decoded to exactly 31 target tokens (EOS barred until then in
fastformer, the decoding length fixed in CTranslate2), so every system does the same work. The systems run in
interleaved rounds (each round times every system once at every batch size, after a warm-up), so that a change in
the machine's load hits them alike; a row reports the median over the rounds. Each system runs in a process of its
own, as it would be deployed: CTranslate2 brings its own OpenMP runtime, and once it has run in a process, the
short parallel regions of fastformer's one-sentence search there took 2-3x as long on the AVX2 test CPU. A system
that cannot run (CTranslate2 refuses bfloat16 on a CPU without its instructions) is a row with status "error" and
the reason its process gave.

Each fastformer row also gives its share of the GEMM floor: the time of the same GEMMs (the encoder's, the
cross-attention keys/values', and 31 steps of the decoder's and the output projection's, at the rows the search
has) run alone through the same converted linear layers, divided by the row's time. CTranslate2's rows carry no
floor: its GEMMs are its own.

The checksums differ between the systems by construction (fastformer's last token is the forced EOS, scored,
CTranslate2's a 31st real token) and between compute types (random weights give near-uniform log-probabilities,
which any rounding reorders); that the systems return the same best hypothesis under the same rules is tested in
tests/test_export.py, and the compute types' agreement on a trained model in tests/test_translator.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

import bench_utils as bu
from baselines import placeholder_vocabulary
from fastformer import Transformer, TransformerConfig
from fastformer.decoding.compiled import compiled_model, extension
from fastformer.translation.export import to_ctranslate2

SOURCE_TOKENS, TARGET_TOKENS, BEAM_SIZE, LENGTH_PENALTY = 20, 31, 4, 0.6
SYSTEMS = ("fastformer-float32", "fastformer-int8", "fastformer-bfloat16", "ctranslate2-float32", "ctranslate2-int8",
           "ctranslate2-bfloat16")
DEFAULT_SYSTEMS = ("fastformer-float32", "fastformer-int8", "ctranslate2-float32", "ctranslate2-int8")


def shape_config(shape: str, vocab: int) -> TransformerConfig:
    if shape == "a":
        return TransformerConfig.tiny(vocab, dropout=0.0)
    return TransformerConfig.base(vocab, dropout=0.0)


def sources(config: TransformerConfig, n_sentences: int, seed: int) -> torch.Tensor:
    """[n_sentences, SOURCE_TOKENS + 1] random ids, each row ending in EOS."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, config.vocab_size, (n_sentences, SOURCE_TOKENS + 1), generator=generator)
    src[:, -1] = config.eos_id
    return src


Translate = Callable[[torch.Tensor], list[list[int]]]


def fastformer_translator(model: Transformer, compute_type: str) -> Translate:
    def translate(src: torch.Tensor) -> list[list[int]]:
        # max_len_b so that EOS is forced at step TARGET_TOKENS - 1, after which hypotheses have TARGET_TOKENS tokens.
        results = model.translate(src, beam_size=BEAM_SIZE, length_penalty=LENGTH_PENALTY, max_len_a=1.0,
                                  max_len_b=TARGET_TOKENS - 1 - src.shape[1], min_len=model.config.max_positions,
                                  compute_type=compute_type)
        return [sentence[0].tokens + [model.config.eos_id] for sentence in results]

    return translate


def ctranslate2_translator(model: Transformer, threads: int, compute_type: str) -> Translate:
    import ctranslate2

    vocabulary = placeholder_vocabulary(model.config)
    out_dir = Path(tempfile.mkdtemp(prefix="fastformer-ct2-"))
    to_ctranslate2(model, vocabulary, out_dir, quantization=compute_type)
    engine = ctranslate2.Translator(str(out_dir), device="cpu", compute_type=compute_type, inter_threads=1,
                                    intra_threads=threads)
    index = {token: i for i, token in enumerate(vocabulary)}

    def translate(src: torch.Tensor) -> list[list[int]]:
        pieces = [[vocabulary[i] for i in row[:-1]] for row in src.tolist()]
        results = engine.translate_batch(pieces, beam_size=BEAM_SIZE, length_penalty=LENGTH_PENALTY,
                                         min_decoding_length=TARGET_TOKENS, max_decoding_length=TARGET_TOKENS,
                                         max_batch_size=0)
        return [[index[p] for p in result.hypotheses[0]] for result in results]

    return translate


def translator(system: str, model: Transformer) -> Translate:
    name, compute_type = system.split("-", 1)
    if name == "fastformer":
        return fastformer_translator(model, compute_type)
    return ctranslate2_translator(model, torch.get_num_threads(), compute_type)


def gemm_floor_seconds(model: Transformer, compute_type: str, n_sentences: int, repeats: int = 5) -> float:
    """The time of one search's GEMMs alone (module docstring), each shape timed through a linear layer converted
    as the search converts it: the minimum over `repeats` runs of the whole sequence. The encoder's run on every
    thread; the rest as the search runs them (csrc/search.cpp): each thread decodes its own group of at least 4
    sentences with single-threaded GEMMs, so they are timed for one group on one thread, the floor were the groups
    not to slow each other down."""
    config = model.config
    d, ff, vocab = config.d_model, config.d_ff, config.vocab_size
    threads = torch.get_num_threads()
    groups = max(1, min(threads, n_sentences // 4))
    group_sentences = -(-n_sentences // groups)
    source_rows, group_source_rows = n_sentences * (SOURCE_TOKENS + 1), group_sentences * (SOURCE_TOKENS + 1)
    step_rows = group_sentences * BEAM_SIZE
    # (out, in, rows, calls) of every GEMM of one search: the encoder's, then one group's, whose first step decodes
    # beam 0 of each sentence only.
    encoder = [(out, inp, source_rows, config.n_encoder_layers) for out, inp in ((3 * d, d), (d, d), (ff, d), (d, ff))]
    per_step = [(vocab, d, 1), (3 * d, d, config.n_decoder_layers), (d, d, 3 * config.n_decoder_layers),
                (ff, d, config.n_decoder_layers), (d, ff, config.n_decoder_layers)]
    group = [(2 * d, d, group_source_rows, config.n_decoder_layers)]
    for out, inp, per_step_calls in per_step:
        group += [(out, inp, group_sentences, per_step_calls),
                  (out, inp, step_rows, per_step_calls * (TARGET_TOKENS - 1))]
    generator = torch.Generator().manual_seed(0)

    def prepared(shapes: list[tuple[int, int, int, int]]) -> list:
        timed = []
        for out, inp, rows, calls in shapes:
            weight = torch.randn(out, inp, generator=generator) * inp ** -0.5
            fbgemm = out != vocab or extension().output_projection_takes_fbgemm()  # as the search's decoder
            linear = extension().PackedLinear(weight, torch.zeros(out), rows, compute_type, fbgemm)
            timed.append((linear, torch.randn(rows, inp, generator=generator), calls))
        return timed

    def best_time(timed: list, n_threads: int) -> float:
        torch.set_num_threads(n_threads)
        try:
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for linear, x, calls in timed:
                    for _ in range(calls):
                        linear(x)
                best = min(best, time.perf_counter() - start)
            return best
        finally:
            torch.set_num_threads(threads)

    return best_time(prepared(encoder), threads) + best_time(prepared(group), 1 if groups > 1 else threads)


def cpu_description() -> str:
    name = platform.processor() or "cpu"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    features = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
                if f in flags]
    return f"{name}, {os.cpu_count()} cores ({' '.join(features) or 'no AVX2'})"


def run_worker(system: str, args: argparse.Namespace) -> None:
    """Times `system` once at each batch size after a warm-up; prints {"n": [seconds, checksum]} as one JSON line."""
    torch.manual_seed(args.seed)  # the same random weights in every process
    config = shape_config(args.shape, args.vocab)
    model = Transformer(config).eval()
    translate = translator(system, model)
    batches = {n: sources(config, n, args.seed) for n in args.sentences}
    for src in batches.values():
        translate(src)  # warm-up: conversion, allocations
    timings = {}
    for n, src in batches.items():
        start = time.perf_counter()
        outputs = translate(src)
        seconds = time.perf_counter() - start
        if sum(len(tokens) for tokens in outputs) != n * TARGET_TOKENS:
            sys.exit(f"{system} decoded {sum(map(len, outputs))} tokens, expected {n * TARGET_TOKENS}")
        timings[n] = [seconds, f"{zlib.crc32(str(outputs).encode()):08x}"]
    print(json.dumps(timings))


def time_in_rounds(args: argparse.Namespace) -> tuple[dict[tuple[str, int], tuple[list[float], str]], dict[str, str]]:
    """-> ((system, sentences) -> (seconds of each round, checksum), system -> why it could not run), every system in
    a process of its own. A system that fails (CTranslate2 refusing a compute type this CPU lacks) is not run again."""
    times: dict[tuple[str, int], list[float]] = {}
    checksums: dict[tuple[str, int], str] = {}
    failed: dict[str, str] = {}
    common = ["--shape", args.shape, "--vocab", str(args.vocab), "--seed", str(args.seed),
              "--sentences", *map(str, args.sentences)]
    for _ in range(args.rounds):
        for system in [s for s in args.systems if s not in failed]:
            done = subprocess.run([sys.executable, __file__, "--worker", system, *common], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                failed[system] = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                print(f"{system} failed: {failed[system]}", flush=True)
                continue
            for n, (seconds, checksum) in json.loads(done.stdout.splitlines()[-1]).items():
                times.setdefault((system, int(n)), []).append(seconds)
                checksums[system, int(n)] = checksum
    return {key: (samples, checksums[key]) for key, samples in times.items() if key[0] not in failed}, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("a", "b"), default="b")
    parser.add_argument("--vocab", type=int, default=37000, help="shared vocabulary size")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS),
                        help="fastformer-<compute type> and ctranslate2-<compute type> rows")
    parser.add_argument("--sentences", type=int, nargs="+", default=[64, 1], help="batch sizes to time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="JSON to write (default: print only)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)  # one system's timings, for main
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args)
        return

    rows = []
    model = None
    timed, failed = time_in_rounds(args)
    for (system, n), (samples, checksum) in timed.items():
        seconds = statistics.median(samples)
        row = {"system": system, "status": "ok", "sentences": n, "seconds": round(seconds, 4),
               "tokens_per_s": round(n * TARGET_TOKENS / seconds, 1),
               "min_tokens_per_s": round(n * TARGET_TOKENS / max(samples), 1),
               "max_tokens_per_s": round(n * TARGET_TOKENS / min(samples), 1), "checksum": checksum}
        if system.startswith("fastformer"):
            if model is None:
                torch.manual_seed(args.seed)
                model = Transformer(shape_config(args.shape, args.vocab)).eval()
            compute_type = system.split("-", 1)[1]
            floor = gemm_floor_seconds(model, compute_type, n)
            row.update(gemm_floor_seconds=round(floor, 4), share_of_gemm_floor=round(floor / seconds, 3),
                       converted_weights_mib=round(compiled_model(model, compute_type).nbytes / 2 ** 20, 1))
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    rows += [{"system": system, "status": "error", "error": why} for system, why in failed.items()]
    if args.out:
        payload = {"command": " ".join([f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", "python",
                                        *sys.argv]),
                   "cpu": cpu_description(), "threads": torch.get_num_threads(), "shape": args.shape,
                   "vocab": args.vocab, "rounds": args.rounds, **bu.environment(torch.device("cpu")),
                   "ctranslate2": _ctranslate2_version(), "rows": rows}
        bu.write_json(args.out, payload)
        print(f"wrote {args.out}")


def _ctranslate2_version() -> str | None:
    try:
        import ctranslate2
    except ImportError:
        return None
    return ctranslate2.__version__


if __name__ == "__main__":
    main()
