"""The translation options of issue 32 on the CPU: their cost against plain beam search, and sampling and scoring
against CTranslate2 at its best, on the same random weights.

    OMP_NUM_THREADS=2 python benchmarks/cpu_options.py --rounds 3 --out runs/benchmarks/cpu_options.json
    OMP_NUM_THREADS=2 python benchmarks/cpu_options.py --baseline-path /tmp/before --rounds 3   # + an older build

The point is cpu_decoding.py's headline: the base model (--shape b) with a 37k vocabulary, 64 sentences of 20
source tokens plus EOS, 2 threads (torch's, OMP_NUM_THREADS), every compute type int8 (the fastest on both
engines; --compute-type changes it). Every hypothesis is decoded to exactly 31 target tokens (EOS barred until it
is forced, the decoding length fixed in CTranslate2), so that every system does the same work; scoring scores 30
random target tokens plus EOS per sentence. tokens_per_s counts those target tokens.

Systems (each in a process of its own, in interleaved rounds; medians over the rounds; steady state first, as
cpu_decoding.py reaches it):
- beam4: plain beam search, beam 4 (the headline); beam4-baseline: the same with the fastformer package found in
  --baseline-path (an installed package of an earlier commit), for "no slower than before";
- beam4-prefix (a 3-token target prefix per sentence), beam4-ngram (no_repeat_ngram_size 3), beam4-repetition
  (repetition_penalty 1.2), beam4-attention (return_attention): each option's cost over beam4;
- greedy (beam 1), sampling (beam 1, top-k 10), ctranslate2-sampling (the same options);
- score (Transformer.score) and ctranslate2-score (score_batch), and their ratio to beam4's time on the same sources.
CTranslate2 runs in each of its modes (baselines.ctranslate2_modes): both threadings where there is more than one
thread ("intra": one batch on intra-op threads; "inter": inter_threads = threads, max_batch_size = ceil(sentences /
threads)), and on an AVX-512 CPU each also with its own kernels forced to AVX-512 (it picks AVX2 for them itself);
ratios take its best one.
Each ratio is also taken round by round under "paired" (beam4 against beam4-baseline, sampling against greedy and
against CTranslate2's sampling, scoring against score_batch and against beam4): the two processes of a round run
minutes apart at most, so a ratio within a round feels less of the machine's drift over the run than the rows'
medians do; the median and range of those ratios.

    OMP_NUM_THREADS=2 python benchmarks/cpu_options.py --one-process --rounds 10 --out runs/benchmarks/costs.json

--one-process times the fastformer systems of one package (not beam4-baseline, score or CTranslate2's) in a single
process instead, one model for all, each system brought to steady state and then all of them called in turn each
round (the order rotated a place a round): each option's time over beam4's and sampling's speed over greedy's are
taken within a round, seconds apart, so that the machine's drift over minutes cancels; the JSON has every round's
seconds and each ratio's median and range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import bench_utils as bu
from baselines import Ctranslate2Mode, ctranslate2_modes
from cpu_decoding import Point, shape_config, sources, steady_call, vocab_size
from cpu_info import cpu_description

SENTENCES, SOURCE_TOKENS, BEAM, TOP_K = 64, 20, 4, 10
TARGET_TOKENS = Point(1, BEAM, SOURCE_TOKENS, (SENTENCES,)).target_tokens
LENGTH_PENALTY = 0.6
FASTFORMER_SYSTEMS = ("beam4", "beam4-baseline", "beam4-prefix", "beam4-ngram", "beam4-repetition",
                      "beam4-attention", "greedy", "sampling", "score")
CTRANSLATE2_SYSTEMS = ("ctranslate2-sampling", "ctranslate2-score")
SYSTEMS = FASTFORMER_SYSTEMS + CTRANSLATE2_SYSTEMS
# Option -> the keyword arguments of Transformer.translate it adds to plain beam search.
OPTIONS = {"beam4": {}, "beam4-baseline": {}, "beam4-ngram": {"no_repeat_ngram_size": 3},
           "beam4-repetition": {"repetition_penalty": 1.2}, "beam4-attention": {"return_attention": True}}

Run = Callable[[], int]  # one timed call -> the target tokens it produced or scored


def targets(config, n_sentences: int, length: int, seed: int) -> list[list[int]]:
    """n_sentences random target id lists of `length` ids (no EOS)."""
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randint(3, config.vocab_size, (n_sentences, length), generator=generator).tolist()


def fastformer_run(system: str, model, src: torch.Tensor, compute_type: str) -> Run:
    target_tokens = TARGET_TOKENS
    if system == "score":
        tgt = targets(model.config, src.shape[0], target_tokens - 1, 0)
        return lambda: sum(len(t) for t in model.score(src, tgt, compute_type=compute_type))
    beam = 1 if system in ("greedy", "sampling") else BEAM
    options = dict(OPTIONS.get(system, {}))
    if system == "sampling":
        options.update(sampling_topk=TOP_K, seed=1)
    if system == "beam4-prefix":
        options["target_prefix"] = [row[:3] for row in targets(model.config, src.shape[0], 3, 1)]

    def run() -> int:
        # max_len_b so that EOS is forced at step target_tokens - 1 (cpu_decoding.py's fastformer_translator).
        results = model.translate(src, beam_size=beam, length_penalty=LENGTH_PENALTY, max_len_a=1.0,
                                  max_len_b=target_tokens - 1 - src.shape[1], min_len=model.config.max_positions,
                                  compute_type=compute_type, return_scores=system not in ("greedy", "sampling"),
                                  **options)
        return sum(len(sentence[0].tokens) + 1 for sentence in results)

    return run


def ctranslate2_run(system: str, model, src: torch.Tensor, compute_type: str, threading: str, threads: int) -> Run:
    from baselines import ctranslate2_engine, placeholder_vocabulary

    vocabulary = placeholder_vocabulary(model.config)
    pieces = [[vocabulary[i] for i in row[:-1]] for row in src.tolist()]
    settings = Ctranslate2Mode(threading).settings(threads, len(pieces))
    engine = ctranslate2_engine(model, vocabulary, compute_type, device="cpu", compute_type=compute_type,
                                inter_threads=settings["inter_threads"], intra_threads=settings["intra_threads"])
    max_batch_size = settings["max_batch_size"]
    target_tokens = TARGET_TOKENS
    if system == "ctranslate2-score":
        tgt = [[vocabulary[i] for i in row] for row in targets(model.config, len(pieces), target_tokens - 1, 0)]
        return lambda: sum(len(r.log_probs) for r in engine.score_batch(pieces, tgt, max_batch_size=max_batch_size))

    def run() -> int:
        results = engine.translate_batch(pieces, beam_size=1, sampling_topk=TOP_K, min_decoding_length=target_tokens,
                                         max_decoding_length=target_tokens, max_batch_size=max_batch_size)
        return sum(len(result.hypotheses[0]) for result in results)

    return run


def model_and_sources(args: argparse.Namespace) -> tuple:
    """On args.threads threads: the random model of args.shape (the same weights in every process) and the
    SENTENCES sources it translates."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from fastformer import Transformer

    config = shape_config(args.shape, args.vocab)
    return Transformer(config).eval(), sources(config, SENTENCES, SOURCE_TOKENS, args.seed)


def run_worker(args: argparse.Namespace) -> None:
    """Times args.worker once after reaching steady state; prints {"seconds": s, "tokens": n, "warmup_calls": c}."""
    if args.worker == "beam4-baseline":
        import fastformer

        imported = Path(fastformer.__file__).resolve()
        if not imported.is_relative_to(args.baseline_path.resolve()):
            # Not the earlier package: a row of the installed one under the baseline's name would compare it to itself.
            sys.exit(f"beam4-baseline imported fastformer from {imported.parent}, not from --baseline-path "
                     f"{args.baseline_path}")
    model, src = model_and_sources(args)
    run = (fastformer_run(args.worker, model, src, args.compute_type) if args.worker in FASTFORMER_SYSTEMS
           else ctranslate2_run(args.worker, model, src, args.compute_type, args.threading, args.threads))
    warmup_calls = steady_call(lambda _: run(), src)
    start = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": tokens, "warmup_calls": warmup_calls}))


def processes(args: argparse.Namespace) -> list[tuple[str, Ctranslate2Mode | None]]:
    """(system, mode) of every process a round starts: each of CTranslate2's modes, None for fastformer's one."""
    runs = []
    for system in args.systems:
        modes = ctranslate2_modes(args.threads, isa_capped=False) if system.startswith("ctranslate2") else [None]
        runs += [(system, mode) for mode in modes]
    return runs


def time_in_rounds(args: argparse.Namespace) -> tuple[dict[tuple[str, str], list[dict]], dict[str, str]]:
    """-> ((system, mode) -> each round's worker output, system -> why it could not run). A system that fails in
    any of its modes is not run again and none of its rows is kept: its other modes' rows alone would pass for
    CTranslate2 at its best."""
    timed: dict[tuple[str, str], list[dict]] = {}
    failed: dict[str, str] = {}
    for round_index in range(args.rounds):
        for system, mode in processes(args):
            if system in failed:
                continue
            threading, mode_name = (mode.threading, mode.name) if mode else ("intra", "intra")
            env = {**(mode.environment(os.environ) if mode else os.environ), "OMP_NUM_THREADS": str(args.threads)}
            command = [sys.executable, __file__, "--worker", system, "--threading", threading, "--threads",
                       str(args.threads), "--shape", args.shape, "--vocab", str(args.vocab), "--seed", str(args.seed),
                       "--compute-type", args.compute_type]
            if system == "beam4-baseline":
                env["PYTHONPATH"] = os.pathsep.join([str(args.baseline_path), env.get("PYTHONPATH", "")])
                command += ["--baseline-path", str(args.baseline_path)]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                failed[system] = f"{why} ({mode_name})" if mode else why
                print(f"{system} failed: {failed[system]}; its rows and ratios are left out", flush=True)
                continue
            timed.setdefault((system, mode_name), []).append(json.loads(done.stdout.splitlines()[-1]))
            print(f"round {round_index + 1}/{args.rounds}: {system} ({mode_name}) done", flush=True)
    return {key: samples for key, samples in timed.items() if key[0] not in failed}, failed


def spread(values: list[float]) -> dict[str, float]:
    """{"median", "min", "max"} of values, to three places."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


ONE_PROCESS_SYSTEMS = ("beam4", "beam4-prefix", "beam4-ngram", "beam4-repetition", "beam4-attention", "greedy",
                       "sampling")


def time_in_one_process(args: argparse.Namespace) -> dict:
    """--one-process (module docstring) -> {"seconds": {system: per round}, "ratios": {name: spread}}."""
    model, src = model_and_sources(args)
    systems = [system for system in ONE_PROCESS_SYSTEMS if system in args.systems]
    runs = {system: fastformer_run(system, model, src, args.compute_type) for system in systems}
    for system, run in runs.items():
        steady_call(lambda _: run(), src)
        print(f"{system}: steady", flush=True)

    def report(round_index: int, seconds: dict[str, list[float]]) -> None:
        print(f"round {round_index + 1}/{args.rounds}: " +
              " ".join(f"{system} {seconds[system][-1]:.3f}s" for system in systems), flush=True)

    seconds = bu.calls_in_turn(runs, args.rounds, report)

    def per_round(numerator: str, denominator: str) -> list[float]:
        return [a / b for a, b in zip(seconds[numerator], seconds[denominator])]

    ratios = {}
    for option in ("prefix", "ngram", "repetition", "attention"):
        if f"beam4-{option}" in seconds and "beam4" in seconds:
            ratios[f"beam4-{option} time / beam4 time"] = spread(per_round(f"beam4-{option}", "beam4"))
    if "sampling" in seconds and "greedy" in seconds:
        ratios["sampling / greedy (speed)"] = spread(per_round("greedy", "sampling"))
    return {"seconds": {system: [round(s, 6) for s in values] for system, values in seconds.items()},
            "ratios": ratios}


def summary(rows: dict[str, dict]) -> dict[str, float]:
    """The ratios issue 32 sets targets for (module docstring); a missing row leaves its ratio out."""
    def best(prefix: str) -> dict | None:
        kept = [row for name, row in rows.items() if name == prefix or name.startswith(prefix + " ")]
        return max(kept, key=lambda row: row["tokens_per_s"]) if kept else None

    def ratio(name: str, numerator: dict | None, denominator: dict | None, key: str = "tokens_per_s") -> None:
        if numerator and denominator:
            ratios[name] = round(numerator[key] / denominator[key], 3)

    ratios: dict[str, float] = {}
    beam4 = best("beam4")
    ratio("beam4 / beam4-baseline (speed)", beam4, best("beam4-baseline"))
    for option in ("prefix", "ngram", "repetition", "attention"):
        ratio(f"beam4-{option} time / beam4 time", beam4, best(f"beam4-{option}"))
    ratio("sampling / greedy (speed)", best("sampling"), best("greedy"))
    ratio("sampling / CTranslate2 sampling at its best", best("sampling"), best("ctranslate2-sampling"))
    ratio("score / CTranslate2 score_batch at its best", best("score"), best("ctranslate2-score"))
    ratio("beam4 time / score time (same sources)", best("score"), beam4, key="seconds_inverse")
    return ratios


# Ratio -> (numerator, denominator): the two systems' speeds on the same sources (every system of a pair decodes or
# scores the same target tokens, so the speed ratio is the denominator's seconds over the numerator's).
PAIRS = {"beam4 / beam4-baseline (speed)": ("beam4", "beam4-baseline"),
         "sampling / greedy (speed)": ("sampling", "greedy"),
         "sampling / CTranslate2 sampling at its best": ("sampling", "ctranslate2-sampling"),
         "score / CTranslate2 score_batch at its best": ("score", "ctranslate2-score"),
         "beam4 time / score time (same sources)": ("score", "beam4")}


def paired_ratios(timed: dict[tuple[str, str], list[dict]], rounds: int) -> dict[str, dict[str, float]]:
    """Each ratio of PAIRS whose two systems ran in every round, taken round by round (the two processes minutes
    apart at most, where the rows' medians may come from rounds far apart), as the median and range over the rounds;
    a system with two threading modes counts its faster one in each round."""
    def round_seconds(system: str) -> list[float] | None:
        modes = [samples for (name, _), samples in timed.items() if name == system]
        if not modes or any(len(samples) != rounds for samples in modes):
            return None
        return [min(samples[r]["seconds"] for samples in modes) for r in range(rounds)]

    paired = {}
    for name, (numerator, denominator) in PAIRS.items():
        fast, slow = round_seconds(numerator), round_seconds(denominator)
        if fast and slow:
            paired[name] = spread([d / n for n, d in zip(fast, slow)])
    return paired


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        help="default: every system (beam4-baseline only with --baseline-path)")
    parser.add_argument("--baseline-path", type=Path, help="a directory holding an installed fastformer package of an "
                        "earlier commit: the beam4-baseline row imports it")
    parser.add_argument("--shape", choices=("a", "b"), default="b", help="a: the tiny preset; b: the base model")
    parser.add_argument("--compute-type", default="int8", choices=("float32", "int8"))
    parser.add_argument("--threads", type=bu.positive_int, default=torch.get_num_threads())
    parser.add_argument("--vocab", type=vocab_size, default=37000)
    parser.add_argument("--rounds", type=bu.positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one-process", action="store_true", help="time fastformer's systems in one process, in "
                        "turn each round (module docstring)")
    parser.add_argument("--out", type=Path, help="JSON to write (default: print only)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--threading", choices=("intra", "inter"), default="intra", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_path and not (args.baseline_path / "fastformer" / "__init__.py").is_file():
        parser.error(f"--baseline-path {args.baseline_path} holds no fastformer package (fastformer/__init__.py)")
    if args.systems is None:
        args.systems = [system for system in SYSTEMS if system != "beam4-baseline" or args.baseline_path]
    if "beam4-baseline" in args.systems and not args.baseline_path:
        parser.error("beam4-baseline times the package in --baseline-path: name one")
    if args.one_process and not args.worker:
        skipped = [system for system in args.systems if system not in ONE_PROCESS_SYSTEMS]
        if len(skipped) == len(args.systems):
            parser.error(f"--one-process times none of --systems {' '.join(skipped)}: only "
                         f"{', '.join(ONE_PROCESS_SYSTEMS)}")
        if skipped:
            print(f"--one-process skips {', '.join(skipped)} (it times only {', '.join(ONE_PROCESS_SYSTEMS)})",
                  file=sys.stderr, flush=True)
    if args.out and not args.worker:
        bu.check_output(parser, "--out", args.out)
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.one_process:
        timings = time_in_one_process(args)
        for name, value in timings["ratios"].items():
            print(f"{name}: {value}", flush=True)
        write_payload(args, timings)
        return
    timed, failed = time_in_rounds(args)
    rows = {}
    several_modes = len(ctranslate2_modes(args.threads, isa_capped=False)) > 1
    for (system, mode), samples in timed.items():
        name = f"{system} {mode}" if system.startswith("ctranslate2") and several_modes else system
        seconds = statistics.median(sample["seconds"] for sample in samples)
        tokens = samples[0]["tokens"]
        rows[name] = {"seconds": round(seconds, 4), "seconds_inverse": 1.0 / seconds, "tokens": tokens,
                      "tokens_per_s": round(tokens / seconds, 1),
                      "spread_tokens_per_s": [round(tokens / max(s["seconds"] for s in samples), 1),
                                              round(tokens / min(s["seconds"] for s in samples), 1)],
                      "warmup_calls": [sample["warmup_calls"] for sample in samples],
                      "round_seconds": [round(sample["seconds"], 4) for sample in samples]}
        if system.startswith("ctranslate2"):
            rows[name].update(Ctranslate2Mode(mode.split()[0]).settings(args.threads, SENTENCES))
        print(f"{name:28s} {rows[name]['tokens_per_s']:>9} tok/s  {rows[name]['seconds']} s", flush=True)
    ratios = summary(rows)
    paired = paired_ratios(timed, args.rounds)
    for name, value in ratios.items():
        print(f"{name}: {value} (from the medians)", flush=True)
    for name, value in paired.items():
        print(f"{name}, round by round: {value}", flush=True)
    for row in rows.values():
        del row["seconds_inverse"]
    write_payload(args, {"rows": rows, "ratios": ratios, "paired": paired, "failed": failed})


def write_payload(args: argparse.Namespace, results: dict) -> None:
    """args.out (when given) <- the run's command, CPU and point, and results."""
    if not args.out:
        return
    payload = {"command": bu.command_line(sys.argv), "cpu": cpu_description(),
               "ctranslate2": bu.ctranslate2_version(), "shape": args.shape, "compute_type": args.compute_type,
               "threads": args.threads, "sentences": SENTENCES, "source_tokens": SOURCE_TOKENS,
               "target_tokens": TARGET_TOKENS, "rounds": args.rounds, **bu.environment(torch.device("cpu")), **results}
    bu.write_json(args.out, payload)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
