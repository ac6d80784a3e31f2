"""CPU decoding in every compute type: fastformer against CTranslate2 at its best, on the same random weights.

    OMP_NUM_THREADS=2 python benchmarks/cpu_decoding.py --shape b --vocab 37000 --rounds 3
    python benchmarks/cpu_decoding.py --sweep --rounds 1 --out runs/benchmarks/cpu_sweep.json

Shapes: "a" is the tiny preset (d_model 64, 2 + 2 layers), "b" the paper's base model (d_model 512, 6 + 6 layers,
d_ff 2048, 8 heads); --vocab sets the shared vocabulary (WMT14's is 37,000). A point is a number of threads, a beam
size and a source length L: each batch is N sentences of L source tokens plus EOS, and every hypothesis is decoded
to exactly 1.5 L + 1 target tokens (EOS barred until then in fastformer, the decoding length fixed in CTranslate2),
so that every system does the same work. --sweep times the points around the headline (64 sentences, beam 4,
20 tokens) on 1 and 2 threads: 1, 8, 64 and 256 sentences; beams 1 and 5; sources of 10 and 50 tokens.

CTranslate2 runs in both of its threading modes wherever there is more than one thread, and every ratio is taken
against the best of its modes at that point: "intra" is one batch on intra-op threads (inter_threads=1,
intra_threads=T); "inter" is its documented throughput mode, batches translated in parallel (inter_threads=T,
intra_threads=1, max_batch_size=ceil(N / T)). On an AVX-512 CPU, where CTranslate2 still runs its own kernels at
AVX2 unless told otherwise, each mode runs again with them forced to AVX-512 (CT2_FORCE_CPU_ISA=AVX512; rows'
ctranslate2_isa), which ran its int8 search up to 12% faster on the Zen 4 EPYC (baselines.ctranslate2_modes); runs
before 2026-11-30's fourth took its AVX2 kernels alone. fastformer has one mode: each thread searches its own group of
sentences, or, where the groups would be too few rows for their GEMMs, one group's GEMMs split over the threads
(csrc/search.cpp's cpu_sentence_groups). On an Intel CPU CTranslate2 runs its GEMMs through Intel MKL, its best
backend there (oneDNN's, CT2_USE_MKL=0, and MKL's int16 were slower on the 2-core Intel Xeon:
results/2026-12-01-cpu-intel-xeon-2core); on a CPU with AMX fastformer's int8 runs its AMX GEMM, which
FASTFORMER_CPU_AMX=0 turns off (the JSON's fastformer_cpu_switches names such a switch).

Each (system, mode, point) runs in a process of its own, as it would be deployed: CTranslate2 brings its own OpenMP
runtime, and once it has run in a process, the short parallel regions of fastformer's one-sentence search there
took 2-3x as long on the AVX2 test CPU. The processes run in interleaved rounds (each round times every system
once at every point), so that a change in the machine's load hits them alike; a row reports the median over the
rounds. Steady state: before it times a batch size, a process repeats that search until a call is no faster than
the best before it by more than 3% (at least 2 calls, at most MAX_WARMUP_CALLS), and the row says how many it took
(warmup_calls): fastformer's first calls convert the weights and grow glibc's arenas. A system that cannot run
(CTranslate2 refuses bfloat16 on a CPU without its instructions) is a row with status "error" and its reason.

Each fastformer row (in a sweep, at the headline shape only) also gives its share of the GEMM floor: the time of the
same GEMMs (the encoder's, the cross-attention keys/values', and every step's decoder and output projection, at the
rows the search has) run alone through the same converted linear layers, in the search's order and each layer with
weights of its own (gemm_floor), divided by the search's time. Where the search takes its candidates from the output
projection's summary (fastformer's own int8 GEMMs and its AVX-512 float32 one: no logits written), the floor times
that projection as it runs there, summary and all. The two are timed side by side in the main process after the
rounds, in turn FLOOR_PAIRS times once the search is steady, and the share is the floor's best over the search's best
(search_seconds_beside_floor): runs before 2026-11-26's seventh took the floor's best of 5 against the rounds'
median, minutes apart, which read it 1-5% low where the machine's speed moved. CTranslate2's GEMMs are its own.
Beside it: the weights a decoding step reads (step_weight_mib, once per thread's group of sentences) and the rate the
row read them at (weight_read_gb_s), against the copy bandwidth of the machine at that many threads
(copy_bandwidth_gb_s in the JSON): a small batch whose rate nears that bandwidth is bound by reading its weights,
which only fewer bytes (int8, a vocabulary shortlist) can speed up. The JSON ends with the point of the lowest ratio
("worst"), for the fastest modes and for float32.

--cap-isa avx2 runs an AVX-512 CPU as an AVX2 one as far as the libraries let it: oneDNN (ONEDNN_MAX_CPU_ISA),
ATen's kernels (ATEN_CPU_CAPABILITY), FBGEMM, which runs fastformer's int8 GEMMs there
(FBGEMM_ENABLE_INSTRUCTIONS), Intel MKL (MKL_ENABLE_INSTRUCTIONS), CTranslate2's own kernels (CT2_FORCE_CPU_ISA) and
fastformer's own loops and its choice of 8-bit int8 activations (FASTFORMER_CPU_ISA) are capped. Runs before
2026-11-27's eighth left FBGEMM uncapped: it ran its AVX512-VNNI kernels, and the 37k-vocabulary projection at 128
rows took 16.9 ms on one thread against 30.5 ms capped (results/2026-11-27-cpu-amd-epyc-2core-h/fbgemm_cap.log), so
their capped int8 figures were faster than an AVX2 CPU's. Runs before 2026-11-28's MKL cap left MKL uncapped, which
CTranslate2 runs every GEMM through on an Intel CPU (AVX-512 and AMX there; on AMD it takes oneDNN, which is capped):
their capped Intel figures are CTranslate2 uncapped. On a CPU with AVX-VNNI the cap keeps it (AVX_VNNI_CAPS): such a
CPU runs as an AVX2 + AVX-VNNI one; --cap-isa avx2-no-vnni runs it as an AVX2 CPU without VNNI (fastformer's
FASTFORMER_CPU_VNNI=0: 7-bit int8 activations and its AVX2 int8 GEMM). The JSON names the caps; the figures are
capped ones, not an AVX2 machine's.

The checksums differ between the systems by construction (fastformer's last token is the forced EOS, scored,
CTranslate2's a last real token) and between compute types (random weights give near-uniform log-probabilities,
which any rounding reorders); that the systems return the same best hypothesis under the same rules is tested in
tests/test_export.py, and the compute types' agreement on a trained model in tests/test_translator.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import bench_utils as bu
from baselines import Ctranslate2Mode, ctranslate2_engine, ctranslate2_modes, placeholder_vocabulary
from cpu_info import cpu_description, cpu_name_and_flags
from fastformer import Transformer, TransformerConfig
from fastformer.decoding.compiled import DECODER_ROWS, ENCODER_ROWS, compiled_model, extension

if TYPE_CHECKING:  # an annotation only: cpu_options.py's beam4-baseline imports this with packages that predate it
    from fastformer import Shortlist

LENGTH_PENALTY = 0.6
SYSTEMS = ("fastformer-float32", "fastformer-int8", "fastformer-bfloat16", "ctranslate2-float32", "ctranslate2-int8",
           "ctranslate2-bfloat16")
DEFAULT_SYSTEMS = ("fastformer-float32", "fastformer-int8", "ctranslate2-float32", "ctranslate2-int8")
THREADINGS = ("intra", "inter")  # CTranslate2's two ways of using several threads (module docstring)
MAX_WARMUP_CALLS = 8
STEADY_TOLERANCE = 0.03
FLOOR_PAIRS = 5  # the GEMM floor and the search, timed in turn (share_of_gemm_floor)
MIN_VOCAB = 4  # ids 0-2 are padding, BOS and EOS: sources draw theirs from 3 up (sources)
# fastformer forces the target's length as max_len_b = target - source tokens - 2 >= 0 (fastformer_translator).
MIN_SOURCE_TOKENS = 2
vocab_size = bu.int_at_least(MIN_VOCAB, "ids 0-2 are padding, BOS and EOS")  # --vocab's type here and in cpu_options.py
HEADLINE = dict(beam=4, source_tokens=20, sentences=64)
# --cap-isa: every library's own cap, so that a newer CPU runs as an older one would (module docstring).
AVX2_CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "CT2_FORCE_CPU_ISA": "AVX2", "FASTFORMER_CPU_ISA": "avx2"}
# avx2-no-vnni: the same without AVX-VNNI in fastformer too (FASTFORMER_CPU_VNNI=0), as Zen 2-4 and Haswell to Ice
# Lake run, on a CPU that has it.
ISA_CAPS = {"avx2": AVX2_CAPS, "avx2-no-vnni": {**AVX2_CAPS, "FASTFORMER_CPU_VNNI": "0"}}
# On a CPU with AVX-VNNI (VNNI on 256-bit vectors), which FASTFORMER_CPU_ISA=avx2 keeps, the libraries that have
# AVX-VNNI code keep it too: the cap is then an AVX2 + AVX-VNNI CPU's, as Intel's Alder Lake and Sierra Forest are.
AVX_VNNI_CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX2_E1"}


@dataclass(frozen=True)
class Point:
    """Where a row is timed: threads, beam size, source tokens (without EOS) and the batch sizes."""
    threads: int
    beam: int
    source_tokens: int
    sentences: tuple[int, ...]

    @property
    def target_tokens(self) -> int:
        return self.source_tokens * 3 // 2 + 1


def sweep_points() -> list[Point]:
    """The sweep (module docstring): every axis varied around the headline, on 1 and 2 threads."""
    points = []
    for threads in (1, 2):
        points += [Point(threads, 4, 20, (1, 8, 64, 256)), Point(threads, 1, 20, (64,)), Point(threads, 5, 20, (64,)),
                   Point(threads, 4, 10, (64,)), Point(threads, 4, 50, (64,))]
    return points


def shape_config(shape: str, vocab: int) -> TransformerConfig:
    if shape == "a":
        return TransformerConfig.tiny(vocab, dropout=0.0)
    return TransformerConfig.base(vocab, dropout=0.0)


def sources(config: TransformerConfig, n_sentences: int, source_tokens: int, seed: int) -> torch.Tensor:
    """[n_sentences, source_tokens + 1] random ids, each row ending in EOS."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, config.vocab_size, (n_sentences, source_tokens + 1), generator=generator)
    src[:, -1] = config.eos_id
    return src


# translate(src) -> each hypothesis's ids; translate(src, True) searches with the translator's shortlist.
Translate = Callable[..., list[list[int]]]


def fastformer_translator(model: Transformer, compute_type: str, point: Point,
                          shortlist: Shortlist | None = None) -> Translate:
    def translate(src: torch.Tensor, shortlisted: bool = False) -> list[list[int]]:
        # max_len_b so that EOS is forced at step target_tokens - 1, after which hypotheses have target_tokens tokens.
        # No scores, as CTranslate2's translate_batch and fastformer's Translator return by default: greedy search
        # then skips the log-softmax in both.
        results = model.translate(src, beam_size=point.beam, length_penalty=LENGTH_PENALTY, max_len_a=1.0,
                                  max_len_b=point.target_tokens - 1 - src.shape[1],
                                  min_len=model.config.max_positions, compute_type=compute_type,
                                  shortlist=shortlist if shortlisted else None, return_scores=False)
        return [sentence[0].tokens + [model.config.eos_id] for sentence in results]

    return translate


def ctranslate2_translator(model: Transformer, compute_type: str, threading: str, point: Point,
                           shortlist: Shortlist | None = None) -> Translate:
    """CTranslate2 on the exported weights; a shortlist becomes its vocabulary map (vmap.txt: each source piece, a
    tab, its candidates; the always-kept pieces on the line of the empty source), which use_vmap turns on."""
    vocabulary = placeholder_vocabulary(model.config)
    files = {}
    if shortlist is not None:
        lines = ["\t" + " ".join(vocabulary[t] for t in shortlist.always.tolist())]
        lines += [vocabulary[source] + "\t" + " ".join(vocabulary[t] for t in candidates if t >= 0)
                  for source, candidates in enumerate(shortlist.candidates.tolist())]
        files["vmap.txt"] = "\n".join(lines) + "\n"
    settings = Ctranslate2Mode(threading).settings
    threads = settings(point.threads, 1)
    engine = ctranslate2_engine(model, vocabulary, compute_type, files, device="cpu", compute_type=compute_type,
                                inter_threads=threads["inter_threads"], intra_threads=threads["intra_threads"])
    index = {token: i for i, token in enumerate(vocabulary)}

    def translate(src: torch.Tensor, shortlisted: bool = False) -> list[list[int]]:
        pieces = [[vocabulary[i] for i in row[:-1]] for row in src.tolist()]
        results = engine.translate_batch(pieces, beam_size=point.beam, length_penalty=LENGTH_PENALTY,
                                         min_decoding_length=point.target_tokens,
                                         max_decoding_length=point.target_tokens,
                                         max_batch_size=settings(point.threads, len(pieces))["max_batch_size"],
                                         use_vmap=shortlisted)
        return [[index[p] for p in result.hypotheses[0]] for result in results]

    return translate


def sentence_groups(point: Point, n_sentences: int, compute_type: str) -> int:
    """The groups of sentences the CPU search runs side by side at a point (csrc/search.cpp's cpu_sentence_groups)."""
    return extension().cpu_sentence_groups(n_sentences, n_sentences * point.beam, compute_type, point.threads)


def gemm_floor(model: Transformer, compute_type: str, point: Point, n_sentences: int) -> Callable[[], float]:
    """-> a call that times one search's GEMMs alone once (module docstring), in the search's order and each layer
    with weights of its own, converted as the search converts them: the encoder's layers in turn on every thread;
    then, as the search runs them (csrc/search.cpp), one group's: where each thread decodes its own group of sentences
    with single-threaded GEMMs, they are timed for one group on one thread, the floor were the groups not to slow each
    other down; where one group's GEMMs split over the threads, on every thread. The group's GEMMs: every decoder
    layer's cross-attention keys and values, then step by step (the first decoding beam 0 of each sentence only) each
    layer's in turn and the output projection, a block of sentences at a time as the search runs it. Before
    benchmarks/results/2026-11-29-cpu-amd-epyc-2core-g/, each shape's calls ran back to back through one layer's
    weights, which then stay in the L2 between calls, as no search can run them: that floor read 1-6% lower at the
    headline on the Zen 5 EPYC, under what the GEMMs take inside the search."""
    config = model.config
    d, ff, vocab, k = config.d_model, config.d_ff, config.vocab_size, point.beam
    threads = point.threads
    groups = sentence_groups(point, n_sentences, compute_type)
    group_sentences = -(-n_sentences // groups)
    source_len = point.source_tokens + 1
    source_rows, group_source_rows = n_sentences * source_len, group_sentences * source_len
    step_rows = group_sentences * k
    generator = torch.Generator().manual_seed(0)
    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def x(rows: int, width: int) -> torch.Tensor:
        if (rows, width) not in inputs:
            inputs[rows, width] = torch.randn(rows, width, generator=generator)
        return inputs[rows, width]

    def linear(out: int, inp: int, rows: int):
        weight = torch.randn(out, inp, generator=generator) * inp ** -0.5
        fbgemm = out != vocab or extension().output_projection_takes_fbgemm()  # as the search's decoder
        return extension().PackedLinear(weight, torch.zeros(out), rows, compute_type, fbgemm)

    # (out, in) of a layer's GEMMs in the order its forward runs them.
    encoder_shapes = [(3 * d, d), (d, d), (ff, d), (d, ff)]
    decoder_shapes = [(3 * d, d), (d, d), (d, d), (d, d), (ff, d), (d, ff)]  # self-attention, cross-attention q / out
    # Each converted for the rows the compiled model converts it for (fastformer/decoding/compiled.py, csrc/decoder.cpp:
    # oneDNN picks its blocking from them).
    encoder = [[linear(out, inp, ENCODER_ROWS) for out, inp in encoder_shapes] for _ in range(config.n_encoder_layers)]
    cross_keys_values = [linear(2 * d, d, 8 * DECODER_ROWS) for _ in range(config.n_decoder_layers)]
    decoder = [[linear(out, inp, DECODER_ROWS) for out, inp in decoder_shapes]
               for _ in range(config.n_decoder_layers)]
    projection = linear(vocab, d, DECODER_ROWS)
    barred = [config.pad_id, config.bos_id]
    # The search's output projection: on a GEMM with a summary, each row's best logits (1 for a greedy search without
    # scores, which the benchmark asks for; else 2 * beam with the log-softmax's terms and EOS's logit) over all of a
    # step's rows (csrc/search.cpp's best_logits_step); otherwise the logits, a block of sentences at a time
    # (sentences_per_block).
    best_needed = 1 if k == 1 else 2 * k
    summarized = projection.has_summary and best_needed <= 64
    most = group_sentences if summarized else max(1, extension().logits_rows_per_block(vocab) // k)
    n_blocks = -(-group_sentences // most)
    block_sentences = -(-group_sentences // n_blocks)

    def project(block_rows: int) -> list[Callable[[], object]]:
        """A step's output projection over blocks of block_rows rows (the last block timed as full)."""
        if summarized and k == 1:
            call = functools.partial(projection.summarize, x(block_rows, d), 1, barred)
        elif summarized:
            eos = torch.full((block_rows,), config.eos_id, dtype=torch.int64)
            call = functools.partial(projection.summarize, x(block_rows, d), best_needed, barred, log_totals=True,
                                     picked_ids=eos)
        else:
            call = functools.partial(projection, x(block_rows, d))
        return [call] * n_blocks

    encoder_calls = [functools.partial(layer, x(source_rows, inp))
                     for layers in encoder for layer, (_, inp) in zip(layers, encoder_shapes)]
    group_calls = [functools.partial(layer, x(group_source_rows, d)) for layer in cross_keys_values]
    first_projection, step_projection = project(block_sentences), project(block_sentences * k)
    for step in range(point.target_tokens):
        rows = group_sentences if step == 0 else step_rows
        group_calls += [functools.partial(layer, x(rows, inp))
                        for layers in decoder for layer, (_, inp) in zip(layers, decoder_shapes)]
        group_calls += first_projection if step == 0 else step_projection

    def seconds(calls: list[Callable[[], object]], n_threads: int) -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(n_threads)
        try:
            start = time.perf_counter()
            for call in calls:
                call()
            return time.perf_counter() - start
        finally:
            torch.set_num_threads(previous)

    return lambda: seconds(encoder_calls, threads) + seconds(group_calls, 1 if groups > 1 else threads)


def share_of_gemm_floor(model: Transformer, compute_type: str, point: Point, n_sentences: int, seed: int,
                        pairs: int = FLOOR_PAIRS) -> tuple[float, float]:
    """The GEMM floor and the search beside it (on the sources the row's processes translate), in turn `pairs` times
    in this process after the search's steady state, so that both see the machine alike -> (the floor's best, the
    search's best) in seconds."""
    floor = gemm_floor(model, compute_type, point, n_sentences)
    translate = fastformer_translator(model, compute_type, point)
    src = sources(model.config, n_sentences, point.source_tokens, seed)
    previous = torch.get_num_threads()
    torch.set_num_threads(point.threads)  # the search's threads, as its worker process had them
    try:
        steady_call(translate, src)
        floors, searches = [], []
        for _ in range(pairs):
            floors.append(floor())
            start = time.perf_counter()
            translate(src)
            searches.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return min(floors), min(searches)


BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2, "int8": 1}


def step_weight_bytes(config: TransformerConfig, compute_type: str) -> int:
    """The weights every decoding step reads once per group of sentences: each decoder layer's self-attention
    (q, k, v, out), cross-attention query and output (its keys/values are made once per search) and feed-forward,
    and the output projection, in the compute type (int8's per-row scales left out)."""
    d, ff = config.d_model, config.d_ff
    per_layer = 4 * d * d + 2 * d * d + 2 * d * ff
    return (config.n_decoder_layers * per_layer + config.vocab_size * d) * BYTES_PER_WEIGHT[compute_type]


def copy_bandwidth_gb_s(threads: int, mib: int = 512) -> float:
    """The memory bandwidth a copy of `mib` MiB reaches on `threads` threads (bytes read + written per second),
    the best of three: the bound on a step that reads weights larger than the caches."""
    source = torch.ones(mib * 2 ** 18)
    target = torch.empty_like(source)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return round(2 * source.numel() * 4 / best / 1e9, 1)


def isa_caps(cap_isa: str | None) -> dict[str, str]:
    """The variables of --cap-isa on this CPU (ISA_CAPS, with AVX_VNNI_CAPS where it has AVX-VNNI)."""
    caps = dict(ISA_CAPS.get(cap_isa, {}))
    if cap_isa == "avx2" and "avx_vnni" in cpu_name_and_flags()[1]:
        caps.update(AVX_VNNI_CAPS)
    return caps


def steady_headline_search(threads: int, sentences: int, compute_type: str) -> tuple[Translate, torch.Tensor]:
    """The headline's fastformer search (the base model with a 37k vocabulary, beam 4, 20-token sources) of
    `sentences` sentences on `threads` threads, brought to its steady state -> (translate, its sources)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Transformer(shape_config("b", 37000)).eval()
    translate = fastformer_translator(model, compute_type, Point(threads, 4, 20, (sentences,)))
    src = sources(model.config, sentences, 20, 0)
    steady_call(translate, src)
    return translate, src


def steady_call(translate: Translate, src: torch.Tensor) -> int:
    """Repeats the search until a call is no faster than the best before it by more than STEADY_TOLERANCE -> calls."""
    best = float("inf")
    for calls in range(1, MAX_WARMUP_CALLS + 1):
        start = time.perf_counter()
        translate(src)
        seconds = time.perf_counter() - start
        if calls >= 2 and seconds >= best * (1 - STEADY_TOLERANCE):
            return calls
        best = min(best, seconds)
    return MAX_WARMUP_CALLS


def run_worker(system: str, threading: str, point: Point, args: argparse.Namespace) -> None:
    """Times `system` once at each batch size of `point` after reaching steady state; prints
    {"n": [seconds, checksum, warm-up calls]} as one JSON line."""
    torch.set_num_threads(point.threads)
    torch.manual_seed(args.seed)  # the same random weights in every process
    config = shape_config(args.shape, args.vocab)
    model = Transformer(config).eval()
    name, compute_type = system.split("-", 1)
    cap = os.environ.get("FASTFORMER_CPU_ISA")
    if name == "fastformer" and cap and extension().cpu_isa() != cap:
        sys.exit(f"fastformer's loops run {extension().cpu_isa()}, not the {cap} FASTFORMER_CPU_ISA asks for")
    translate = (fastformer_translator(model, compute_type, point) if name == "fastformer"
                 else ctranslate2_translator(model, compute_type, threading, point))
    timings = {}
    for n in point.sentences:
        src = sources(config, n, point.source_tokens, args.seed)
        warmup_calls = steady_call(translate, src)
        start = time.perf_counter()
        outputs = translate(src)
        seconds = time.perf_counter() - start
        if sum(len(tokens) for tokens in outputs) != n * point.target_tokens:
            sys.exit(f"{system} decoded {sum(map(len, outputs))} tokens, expected {n * point.target_tokens}")
        timings[n] = [seconds, f"{zlib.crc32(str(outputs).encode()):08x}", warmup_calls]
    print(json.dumps(timings))


def runs(systems: list[str], points: list[Point],
         isa_capped: bool) -> list[tuple[str, Ctranslate2Mode | None, Point]]:
    """(system, mode, point) of every process a round starts: CTranslate2 in each of its modes (ctranslate2_modes),
    fastformer (mode None) in its one."""
    return [(system, mode, point) for point in points for system in systems
            for mode in (ctranslate2_modes(point.threads, isa_capped) if system.startswith("ctranslate2") else [None])]


def _worker_command(system: str, threading: str, point: Point, args: argparse.Namespace) -> list[str]:
    return [sys.executable, __file__, "--worker", system, "--threading", threading, "--shape", args.shape,
            "--vocab", str(args.vocab), "--seed", str(args.seed), "--threads", str(point.threads),
            "--beam", str(point.beam), "--source-tokens", str(point.source_tokens),
            "--sentences", *map(str, point.sentences)]


Key = tuple[str, Ctranslate2Mode | None, Point, int]  # system, CTranslate2's mode (fastformer: None), point, sentences


def time_in_rounds(args: argparse.Namespace, points: list[Point]) -> tuple[dict[Key, list], dict[str, str]]:
    """-> ((system, mode, point, sentences) -> [seconds of each round, checksum, warm-up calls of each round],
    system -> why it could not run). A system that fails (CTranslate2 refusing a compute type this CPU lacks) is not
    run again."""
    timed: dict[Key, list] = {}
    failed: dict[str, str] = {}
    cap = isa_caps(args.cap_isa).get("CT2_FORCE_CPU_ISA")
    for round_index in range(args.rounds):
        for system, mode, point in runs(args.systems, points, bool(args.cap_isa)):
            if system in failed:
                continue
            # --cap-isa's CT2_FORCE_CPU_ISA is deliberate; one exported in the shell would mislabel "its own pick".
            env = {**(mode.environment(os.environ, cap) if mode else os.environ), "OMP_NUM_THREADS": str(point.threads)}
            threading = mode.threading if mode else "intra"
            done = subprocess.run(_worker_command(system, threading, point, args), capture_output=True, text=True,
                                  env=env)
            if done.returncode != 0:
                failed[system] = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                print(f"{system} failed: {failed[system]}", flush=True)
                continue
            for n, (seconds, checksum, warmup_calls) in json.loads(done.stdout.splitlines()[-1]).items():
                samples = timed.setdefault((system, mode, point, int(n)), [[], checksum, []])
                samples[0].append(seconds)
                samples[2].append(warmup_calls)
            print(f"round {round_index + 1}/{args.rounds}: {system} ({mode.name if mode else threading}) "
                  f"{point.threads} threads, beam {point.beam}, {point.source_tokens} tokens done", flush=True)
    return {key: value for key, value in timed.items() if key[0] not in failed}, failed


def is_headline(point: Point, n_sentences: int) -> bool:
    return (point.beam, point.source_tokens, n_sentences) == tuple(HEADLINE.values())


def comparisons(rows: list[dict]) -> list[dict]:
    """Per point: fastformer's fastest against CTranslate2's best (any compute type, either threading), float32
    against CTranslate2's best float32, and the same against CTranslate2's intra-op mode alone (the older
    comparison)."""
    by_point: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok":
            by_point.setdefault((row["threads"], row["beam"], row["source_tokens"], row["sentences"]), []).append(row)
    table = []
    for (threads, beam, source_tokens, sentences), point_rows in sorted(by_point.items()):
        def best(keep: Callable[[dict], bool]) -> dict | None:
            kept = [row for row in point_rows if keep(row)]
            return max(kept, key=lambda row: row["tokens_per_s"]) if kept else None

        ours = best(lambda row: row["system"].startswith("fastformer"))
        ours_float32 = best(lambda row: row["system"] == "fastformer-float32")
        theirs = best(lambda row: row["system"].startswith("ctranslate2"))
        theirs_float32 = best(lambda row: row["system"] == "ctranslate2-float32")
        theirs_intra = best(lambda row: row["system"].startswith("ctranslate2") and row["threading"] == "intra")
        entry = {"threads": threads, "beam": beam, "source_tokens": source_tokens, "sentences": sentences}
        for label, mine, other in (("fastest", ours, theirs), ("float32", ours_float32, theirs_float32),
                                   ("fastest_vs_intra_only", ours, theirs_intra)):
            if mine and other:
                entry[label] = {"fastformer": _label(mine), "ctranslate2": _label(other),
                                "ratio": round(mine["tokens_per_s"] / other["tokens_per_s"], 3)}
        table.append(entry)
    return table


def worst_points(table: list[dict]) -> dict:
    """The point of the lowest ratio, for the fastest modes and for float32 (the sweep's headline figures)."""
    worst = {}
    for label in ("fastest", "float32"):
        measured = [entry for entry in table if label in entry]
        if measured:
            worst[label] = min(measured, key=lambda entry: entry[label]["ratio"])
    return worst


def _label(row: dict) -> str:
    mode = f" {row['threading']}" if row["system"].startswith("ctranslate2") and row["threads"] > 1 else ""
    if row.get("ctranslate2_isa", "its own pick") != "its own pick":
        mode += f" {row['ctranslate2_isa']}"
    return f"{row['system']}{mode} {row['tokens_per_s']} tok/s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("a", "b"), default="b")
    parser.add_argument("--vocab", type=vocab_size, default=37000, help="shared vocabulary size")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS),
                        help="fastformer-<compute type> and ctranslate2-<compute type> rows")
    parser.add_argument("--sentences", type=bu.positive_int, nargs="+", default=[64, 1], help="batch sizes to time")
    parser.add_argument("--threads", type=bu.positive_int, nargs="+",
                        help="thread counts (default: torch's, OMP_NUM_THREADS)")
    parser.add_argument("--beam", type=bu.positive_int, nargs="+", default=[HEADLINE["beam"]],
                        help="beam sizes (1: greedy)")
    parser.add_argument("--source-tokens", nargs="+", default=[HEADLINE["source_tokens"]],
                        type=bu.int_at_least(MIN_SOURCE_TOKENS, "a shorter one's target is no longer than it with EOS"),
                        help="source lengths without EOS; the target is 1.5x as long, plus one token")
    parser.add_argument("--sweep", action="store_true", help="the sweep's points (module docstring) instead of "
                        "--sentences/--threads/--beam/--source-tokens")
    parser.add_argument("--cap-isa", choices=tuple(ISA_CAPS), help="run this CPU as one with this instruction set at "
                        "most (module docstring: FBGEMM is not capped)")
    parser.add_argument("--rounds", type=bu.positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="JSON to write (default: print only)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)  # one system's timings, for main
    parser.add_argument("--threading", choices=THREADINGS, default="intra", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.out and not args.worker:
        bu.check_output(parser, "--out", args.out)
    caps = isa_caps(args.cap_isa)
    if any(os.environ.get(name) != value for name, value in caps.items()):
        # The libraries read their caps when they first run: the whole run starts again with them set.
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], {**os.environ, **caps})
    if args.worker:
        point = Point(args.threads[0], args.beam[0], args.source_tokens[0], tuple(args.sentences))
        run_worker(args.worker, args.threading, point, args)
        return
    if args.sweep:
        points = sweep_points()
    else:
        points = [Point(threads, beam, source_tokens, tuple(args.sentences))
                  for threads in args.threads or [torch.get_num_threads()] for beam in args.beam
                  for source_tokens in args.source_tokens]

    rows = []
    model = None
    timed, failed = time_in_rounds(args, points)
    for (system, mode, point, n), (samples, checksum, warmup_calls) in timed.items():
        seconds = statistics.median(samples)
        tokens = n * point.target_tokens
        row = {"system": system, "threading": mode.threading if mode else "intra", "status": "ok",
               "threads": point.threads,
               "beam": point.beam, "source_tokens": point.source_tokens, "target_tokens": point.target_tokens,
               "sentences": n, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
               "min_tokens_per_s": round(tokens / max(samples), 1),
               "max_tokens_per_s": round(tokens / min(samples), 1), "warmup_calls": warmup_calls,
               "checksum": checksum}
        if mode:
            row.update(ctranslate2_isa=mode.isa or "its own pick", **mode.settings(point.threads, n))
        if system.startswith("fastformer") and (not args.sweep or is_headline(point, n)):
            if model is None:
                torch.manual_seed(args.seed)
                model = Transformer(shape_config(args.shape, args.vocab)).eval()
            compute_type = system.split("-", 1)[1]
            floor, search = share_of_gemm_floor(model, compute_type, point, n, args.seed)
            groups = sentence_groups(point, n, compute_type)
            step_bytes = step_weight_bytes(model.config, compute_type)
            row.update(gemm_floor_seconds=round(floor, 4), search_seconds_beside_floor=round(search, 4),
                       share_of_gemm_floor=round(floor / search, 3),
                       converted_weights_mib=round(compiled_model(model, compute_type).nbytes / 2 ** 20, 1),
                       step_weight_mib=round(step_bytes / 2 ** 20, 1),
                       weight_read_gb_s=round(groups * step_bytes * point.target_tokens / seconds / 1e9, 1))
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    rows += [{"system": system, "status": "error", "error": why} for system, why in failed.items()]
    table = comparisons(rows)
    for entry in table:
        print(json.dumps(entry), flush=True)
    worst = worst_points(table)
    print("worst points:", json.dumps(worst), flush=True)
    if args.out:
        payload = {"command": bu.command_line(sys.argv),
                   "cpu": cpu_description(), "isa_caps": caps, "fastformer_cpu_isa": extension().cpu_isa(),
                   "shape": args.shape, "vocab": args.vocab, "rounds": args.rounds,
                   "points": [asdict(point) for point in points], **bu.environment(torch.device("cpu")),
                   "copy_bandwidth_gb_s": {threads: copy_bandwidth_gb_s(threads)
                                           for threads in sorted({point.threads for point in points})},
                   "ctranslate2": bu.ctranslate2_version(), "comparisons": table, "worst": worst,
                   "rows": rows}
        bu.write_json(args.out, payload)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
