"""fastformer: train, translate, evaluate and average Transformer translation models (the paper's recipe).

The command line, `fastformer {demo,train,prepare,translate,score,evaluate,average,export,plot}` (also
`python -m fastformer`).
`fastformer demo` is the whole job on the bundled corpus: train the tiny preset a fixed number of updates, translate
the held-out test split with beam search, print sacreBLEU and throughput. It runs unchanged under torchrun and on a
GPU. `fastformer prepare` tokenizes a corpus once for every later run (train does it itself when needed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import signal
import sys
import time
import traceback
import types
import typing
from pathlib import Path

import torch
import torch.distributed as dist

from fastformer import checkpoint
from fastformer.data import find_split, read_parallel
from fastformer.data.reading import count_lines, open_binary
from fastformer.decoding.compiled import COMPUTE_TYPES, extension
from fastformer.decoding.rules import (LENGTH_PENALTY_FORMS, check_history_arguments, check_sampling_arguments,
                                      check_search_arguments)
from fastformer.decoding.shortlist import Shortlist, build_shortlist
from fastformer.training import run_control
from fastformer.training.curves import CURVES_FILE, plot_curves
from fastformer.training.init_from import load_initial_model
from fastformer.training.run_corpus import prepare_run_corpora
from fastformer.training.options import TrainOptions
from fastformer.training.trainer import Trainer, TrainResult, check_run, process_rank
from fastformer.translation import evaluate, export
from fastformer.translation.output import OUTPUT_FORMATS, format_results
from fastformer.translation.streaming import ChunkFunction, ChunkOutput, LineInput, StdinLines, stream_chunks
from fastformer.translation.translator import OnTruncated, Translator, load_checkpoint_tokenizers, load_translator

# The demo fits the bundled corpus and a few CPU minutes: small updates, so that it takes many steps, with a short
# warmup and a raised peak learning rate. Its length is a fixed number of updates, not a time, so that its result is
# the same on any machine: on a quiet 2-core CPU (about 22 updates/s) DEMO_STEPS take about 3 minutes; validation BLEU
# passes 70 after 500 updates and 95 after 1500.
DEMO_STEPS = 4000
DEMO_DEFAULTS = dict(out_dir="runs/demo", preset="tiny", batch_tokens=1500, update_tokens=1500, warmup=500,
                     lr_scale=2.0, max_steps=DEMO_STEPS, max_minutes=0.0, log_every=100, valid_every=500,
                     valid_bleu_sentences=100, save_every=500)
# What decides a preparation (and where it goes): `fastformer prepare` takes these of train's options.
PREPARE_OPTIONS = ("data_dir", "extra_data", "tag_extra", "init_from", "prepared_dir", "src_lang", "tgt_lang",
                   "vocab_size", "min_len", "max_len", "max_ratio", "quiet")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it has none (None) or is an off-by-default switch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


HELP_FORMAT = dict(formatter_class=_HelpFormatter)
BEAM = 4  # --beam's default (translate's when not sampling)


def _add_train_options(parser: argparse.ArgumentParser, defaults: dict, flags: dict[str, str] | None = None,
                       only: tuple[str, ...] | None = None) -> None:
    """One flag per TrainOptions field (those named in `only`, if given; --batch-tokens for batch_tokens, unless
    `flags` names another), with the field's type and default."""
    hints = typing.get_type_hints(TrainOptions)
    for option in dataclasses.fields(TrainOptions):
        if only is not None and option.name not in only:
            continue
        flag = (flags or {}).get(option.name, "--" + option.name.replace("_", "-"))
        default = defaults.get(option.name, option.default)
        kind = hints[option.name]
        help_text = option.metadata["help"]
        if kind is bool:
            parser.add_argument(flag, dest=option.name, action="store_true", default=default, help=help_text)
            continue
        if isinstance(kind, types.UnionType):  # X | None: the flag takes an X
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        if typing.get_origin(kind) is list:  # list[X]: the flag is repeated, each time with an X
            parser.add_argument(flag, dest=option.name, type=typing.get_args(kind)[0], action="append",
                                default=default, help=help_text)
            continue
        parser.add_argument(flag, dest=option.name, type=kind, default=default, help=help_text)
    if only is not None:
        return
    parser.add_argument("--overwrite", action="store_true",
                        help="delete --out-dir's checkpoints first (else they stop a fresh run)")


def _train_options(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(**{option.name: getattr(args, option.name) for option in dataclasses.fields(TrainOptions)
                           if hasattr(args, option.name)})


def _old_checkpoints(options: TrainOptions, overwrite: bool) -> list[Path]:
    """A fresh run must not mix with an old one's checkpoints: resume it, or overwrite it explicitly -> the
    checkpoints --overwrite deletes (none for --resume), or an error naming why the run cannot start."""
    out_dir = Path(options.out_dir)
    best = checkpoint.best_checkpoint_path(out_dir)
    old = checkpoint.list_checkpoints(out_dir) + ([best] if best.is_file() else [])
    if options.resume or not old:
        return []
    if not overwrite:
        raise ValueError(f"{out_dir} already holds checkpoints ({old[-1].name}): pass --resume to continue that "
                         f"run, --overwrite to start over, or another --out-dir")
    if options.init_from is not None and any(path.resolve() == Path(options.init_from).resolve() for path in old):
        raise ValueError(f"--init-from {options.init_from} is one of the checkpoints --overwrite would delete: copy "
                         f"it out of {out_dir} first, or use another --out-dir")
    return old


class _Terminated(BaseException):
    """SIGTERM before training began (a BaseException, so that no `except Exception` on the way keeps it)."""


@contextlib.contextmanager
def _sigterm_raises(error: BaseException) -> typing.Iterator[None]:
    """SIGTERM (a job scheduler's preemption) raises `error` in the block, so that the code's own cleanup runs (a half
    prepared corpus is removed) and what was kept is said, rather than the default action ending the process at
    once; the handler found is given back."""
    def raise_error(signum: int, frame: types.FrameType | None) -> None:
        raise error

    previous = signal.signal(signal.SIGTERM, raise_error)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped_before_training(command: str) -> typing.NoReturn:
    """Ends a train, demo or prepare stopped by SIGTERM while it prepared its corpus or built its model."""
    if process_rank() == 0:
        print(f"fastformer {command}: stopped by SIGTERM before training (nothing was kept): run the same command "
              "again", file=sys.stderr)
    raise SystemExit(run_control.EXIT_STOPPED if command != "prepare" else 128 + signal.SIGTERM)


def _run_train(args: argparse.Namespace) -> TrainResult:
    """Trains (rank 0 holding out_dir's lock); a run stopped by a signal ends here with its resume command and exit
    status run_control.EXIT_STOPPED."""
    options = _train_options(args)
    checked = check_run(options)
    with run_control.out_dir_lock(Path(options.out_dir), process_rank()):
        # Rank 0 alone, holding the lock, judges the out-dir (another rank would misjudge a busy one) and deletes the
        # old files (the fresh run retrains the vocabulary); if it refuses, torchrun stops the other ranks.
        old = _old_checkpoints(options, args.overwrite) if process_rank() == 0 else []
        # Every option, the data and the model are checked (and built) before --overwrite deletes anything.
        try:
            with _sigterm_raises(_Terminated()):
                trainer = Trainer(options, checked)
        except _Terminated:
            _stopped_before_training(args.command)
        if process_rank() == 0:
            for path in old:
                path.unlink(missing_ok=True)
        result = trainer.run()
    if result.stopped_by is not None:
        if process_rank() == 0:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            print(run_control.stopped_message(result.step, result.checkpoint, result.stopped_by, args.argv, world_size,
                                              local_world_size), file=sys.stderr)
        raise SystemExit(run_control.EXIT_STOPPED)
    if process_rank() == 0:
        if result.out_of_patience:
            print(_patience_message(args.command, options, result))
        if math.isnan(result.train_loss):  # every update logs its interval's loss: this session made none
            print(f"no update to make: {result.checkpoint} is at step {result.step}"
                  + ("" if result.out_of_patience else f", and --max-steps is {options.max_steps}: raise it to train "
                     "further"))
        else:
            time_limit = "--minutes" if args.command == "demo" else "--max-minutes"
            capped = (f" (of {options.max_steps}: {time_limit} {options.max_minutes:g} stopped it)"
                      if result.step < options.max_steps and not result.out_of_patience else "")
            print(f"trained {result.step} steps{capped}: {result.tokens_per_second:,.0f} target tokens/s, final train "
                  f"loss {result.train_loss:.3f}; checkpoint {result.checkpoint}")
    return result


def _patience_message(command: str, options: TrainOptions, result: TrainResult) -> str:
    """The line of a run that --patience ended: why, where, and its best step and score."""
    best = result.best
    return (f"fastformer {command}: stopped at step {result.step}: {options.patience} validations in a row without a "
            f"better valid {best['metric']} (--patience {options.patience}); best: step {best['step']}, valid "
            f"{best['metric']} {best['score']:.4f}, {checkpoint.best_checkpoint_path(Path(options.out_dir))}")


def _run_prepare(args: argparse.Namespace) -> None:
    options = _train_options(args)
    initial = None if options.init_from is None else load_initial_model(options.init_from)
    try:
        with _sigterm_raises(_Terminated()):
            corpora = prepare_run_corpora(options, None if initial is None else initial.tokenizers)
    except _Terminated:
        _stopped_before_training(args.command)
    for corpus in corpora:
        print(f"prepared corpus: {corpus.path} ({len(corpus.train):,} training pairs, vocabulary "
              f"{corpus.tokenizers.vocab_size:,})")


def _run_demo(args: argparse.Namespace) -> None:
    extension()  # the demo ends translating: without the compiled search, fail before training, not after
    result = _run_train(args)
    if process_rank() == 0:
        _evaluate(result.checkpoint, None if args.data_dir is None else Path(args.data_dir), "test",
                  args.src_lang, args.tgt_lang, beam_size=4, length_penalty=0.6, device=_inference_device(args.device),
                  output=None, max_sentences=args.max_sentences)


def _inference_device(device: str) -> torch.device:
    return evaluate.resolve_device(device)


def _report_truncation(command: str, source: str, first: int = 0) -> OnTruncated:
    """-> an on_truncated callback that warns on stderr, naming the line of `source` that was cut (the sentences
    given to the translator starting at its line first + 1)."""
    def report(index: int, n_tokens: int, limit: int) -> None:
        print(f"fastformer {command}: warning: line {first + index + 1} of {source} has {n_tokens} source tokens, "
              f"more than the model's limit of {limit}: only its first {limit} were translated", file=sys.stderr)
    return report


def _evaluate(checkpoint_path: Path, data_dir: Path | None, split: str, src_lang: str, tgt_lang: str,
              beam_size: int, length_penalty: float, device: str, output: Path | None, max_sentences: int = 0,
              length_penalty_form: str = "gnmt", compute_type: str | None = None,
              shortlist_path: str | None = None, batch_tokens: int = 4096) -> float:
    """Translates a split (its first max_sentences, if > 0), prints cased sacreBLEU (13a and intl) with signatures;
    -> the 13a score."""
    files = find_split(data_dir, split, src_lang, tgt_lang)
    _check_output(None if output is None else str(output), [(f"the {split} split's", files.src),
                                                            (f"the {split} split's", files.tgt),
                                                            ("--checkpoint", checkpoint_path),
                                                            ("--shortlist", shortlist_path)])
    pairs = read_parallel(files.src, files.tgt)
    if not pairs:
        raise ValueError(f"the {split} split ({files.src}, {files.tgt}) has no sentence pairs: nothing to evaluate")
    if max_sentences > 0:
        pairs = pairs[:max_sentences]
    translator = load_translator(checkpoint_path, device, compute_type)
    shortlist = _load_shortlist(shortlist_path, translator)
    start = time.perf_counter()
    hypotheses = translator.translate([pair[0] for pair in pairs], beam_size=beam_size, length_penalty=length_penalty,
                                       length_penalty_form=length_penalty_form, shortlist=shortlist,
                                       batch_tokens=batch_tokens,
                                       on_truncated=_report_truncation("evaluate", str(files.src)))
    elapsed = time.perf_counter() - start
    if output is not None:
        output.write_text("".join(line + "\n" for line in hypotheses), encoding="utf-8")
    generated = sum(len(ids) + 1 for ids in translator.target_tokenizer.encode(hypotheses))
    print(f"translated {len(pairs)} sentences of {files.src} on {device} in {elapsed:.1f}s "
          f"({len(pairs) / elapsed:.1f} sentences/s, {generated / elapsed:,.0f} generated tokens/s, beam {beam_size}; "
          f"compute type {translator.compute_type}, converted weights {translator.converted_nbytes / 2**20:.1f} MiB)")
    results = evaluate.bleu(hypotheses, [pair[1] for pair in pairs])
    for _, line in results:
        print(line)
    return results[0][0]


def _newest_checkpoint(args: argparse.Namespace) -> Path:
    if args.checkpoint is not None:
        return Path(args.checkpoint)
    try:
        return checkpoint.newest_checkpoint(Path(args.out_dir))
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{error}: pass --checkpoint") from None


def _line_input(stack: contextlib.ExitStack, flag: str, path: str | None) -> LineInput:
    """An input of a streamed command: `flag`'s file, counted first (for the progress bar and the checks made before
    any work), a pipe (`<(zcat f.gz)`, read once, so not counted), or stdin where path is None."""
    if path is None:
        fd = _stdin_fd()
        if fd is None:
            return LineInput("stdin", sys.stdin.buffer)
        stdin = StdinLines(fd)
        return LineInput("stdin", stdin, ready=stdin.ready)
    if not Path(path).exists():
        raise FileNotFoundError(f"{flag} file not found: {path}")
    if Path(path).is_dir():
        raise IsADirectoryError(f"{flag} {path} is a directory, not a text file")
    count = count_lines(Path(path)) if Path(path).is_file() else None
    return LineInput(path, stack.enter_context(open_binary(Path(path))), count)


def _stdin_fd() -> int | None:
    """sys.stdin's file descriptor; None for a stand-in without one (a program that runs main() on a StringIO)."""
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError):
        return None


def _read(flag: str, path: str | None) -> tuple[str, str | None]:
    """A streamed input as _check_output takes it: standard input's file where path is None (`--output F < F`)."""
    if path is not None:
        return flag, path
    fd = _stdin_fd()
    return "standard input", None if fd is None else f"/dev/fd/{fd}"


def _check_output(output: str | None, read: list[tuple[str, str | Path | None]], text: bool = True,
                  parent_made: bool = False) -> None:
    """--output must not be, nor lie in, what the command reads (read: (option, path) pairs, a path None where not
    given: its inputs, the model file or directory, a shortlist), which the first write would destroy; a text output
    must not be named .gz (it is written as plain text); and unless the command makes the output's directory
    (parent_made), that directory must exist and the output not be one."""
    if output is None:
        return
    target = Path(output)
    if text and output.endswith(".gz"):
        raise ValueError(f"--output {output} ends in .gz, but the output is written as plain text: drop the .gz, or "
                         f"leave out --output and pipe standard output through gzip")
    if not parent_made:
        if target.is_dir():
            raise IsADirectoryError(f"--output {output} is a directory, not a file to write")
        if not target.resolve().parent.is_dir():
            raise FileNotFoundError(f"--output {output}: its directory does not exist")
    for option, path in read:
        if path is None or not Path(path).exists():
            continue
        path = Path(path)
        inside = path.is_dir() and target.resolve().is_relative_to(path.resolve())
        if inside or (target.exists() and target.samefile(path)):
            raise ValueError(f"--output {output} {'lies in' if inside else 'is'} {option} {path}, which this command "
                             f"reads: writing it would destroy it")


def _file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, or of a directory's files (names and bytes, in sorted order): what a model
    (a checkpoint, an OPUS-MT directory) or a shortlist was, so that --resume can tell a changed one."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else "").encode() + b"\0")
        with open(file, "rb") as stream:
            while block := stream.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def _stream(args: argparse.Namespace, inputs: list[LineInput], start: typing.Callable[[], ChunkFunction],
            settings: dict[str, object], read: list[tuple[str, str | Path | None]]) -> None:
    """Streams a command's inputs through its chunk function into --output (or stdout), as --chunk-lines and
    --resume say, then prints the run's summary line on stderr. read: what the command reads (_check_output), whose
    model and shortlist files an output's settings identify by their bytes, so that --resume can tell a changed one
    at the same path."""
    if args.resume and args.output is None:
        raise ValueError("--resume needs --output: the output of an interrupted run is continued in its file")
    if args.chunk_lines < 1:
        raise ValueError(f"--chunk-lines must be >= 1, got {args.chunk_lines}")
    _check_output(args.output, read)
    if args.output is not None:  # standard output keeps no settings: reading the model again would be wasted
        settings = settings | {f"the {option.removeprefix('--')}'s SHA-256": _file_sha256(Path(path))
                               for option, path in read if option in ("--checkpoint", "--shortlist") and path}
    try:
        # SIGTERM goes through the runner, which says what was kept, as Ctrl-C does.
        with _sigterm_raises(SystemExit(128 + signal.SIGTERM)):
            summary = stream_chunks(inputs, start, None if args.output is None else Path(args.output), settings,
                                    args.chunk_lines, args.resume, args.command)
    except KeyboardInterrupt:  # Ctrl-C: the runner has said what was kept; no traceback
        raise SystemExit(128 + signal.SIGINT) from None
    print(summary.line(args.command), file=sys.stderr)


# translate's options that shape its output: a resumed run must have the same (--checkpoint, --prefix-file and
# --shortlist too).
TRANSLATE_SETTINGS = ("beam", "length_penalty", "length_penalty_form", "compute_type", "output_format", "n_best",
                      "print_alignment", "sampling_topk", "sampling_topp", "sampling_temperature", "seed",
                      "no_repeat_ngram_size", "repetition_penalty")


def _run_translate(args: argparse.Namespace) -> None:
    device = _inference_device(args.device)
    sampling = args.sampling_topk != 1
    if args.beam is None:
        args.beam = 1 if sampling else BEAM
    elif sampling and args.beam != 1:
        raise ValueError(f"--sampling-topk {args.sampling_topk} draws with --beam 1 (the default when sampling); "
                         f"--beam {args.beam} would make it a stochastic beam search, which fastformer does not run "
                         "(--n-best N gives N samples a line)")
    if args.n_best > 1 and args.output_format == "text":
        raise ValueError(f"--n-best {args.n_best} gives several translations per line: use --output-format jsonl")
    if not sampling and (args.sampling_topp != 1.0 or args.sampling_temperature != 1.0):
        raise ValueError("--sampling-topp and --sampling-temperature shape sampling, which --sampling-topk turns on "
                         "(0: the whole vocabulary, K: the K likeliest tokens); without it the search is not sampled")
    # Checked now, not at the first line with text (an input of blank lines would never check them); the length
    # limits are translate's own, which the command line leaves as they are.
    check_search_arguments(args.beam, args.length_penalty, 0.0, 0, 0, args.n_best, args.length_penalty_form,
                           sampling=sampling)
    check_sampling_arguments(args.beam, args.sampling_topk, args.sampling_topp, args.sampling_temperature, args.seed)
    check_history_arguments(args.no_repeat_ngram_size, args.repetition_penalty)
    path = _newest_checkpoint(args)
    if not path.exists():  # now: the model loads only once a first chunk is read, and an empty input has none
        raise FileNotFoundError(f"checkpoint not found: {path}")
    settings = {"--" + name.replace("_", "-"): getattr(args, name) for name in TRANSLATE_SETTINGS}
    settings |= {"--checkpoint": str(path.resolve())}
    settings |= {option: None if value is None else str(Path(value).resolve())
                 for option, value in (("--prefix-file", args.prefix_file), ("--shortlist", args.shortlist))}
    if args.shortlist is not None:
        # A shortlist's vocabulary is its batch's union, so a sentence's output depends on its batch: these fix them.
        settings |= {"--chunk-lines": args.chunk_lines, "--batch-tokens": args.batch_tokens}

    def start() -> ChunkFunction:
        translator = load_translator(path, device, args.compute_type)
        return functools.partial(_translate_chunk, translator, _load_shortlist(args.shortlist, translator), args)

    with contextlib.ExitStack() as stack:
        inputs = [_line_input(stack, "--input", args.input)]
        if args.prefix_file is not None:
            inputs.append(_line_input(stack, "--prefix-file", args.prefix_file))
        if args.shortlist is not None:  # whole chunks from standard input too, whenever its lines come
            inputs = [item._replace(ready=None) for item in inputs]
        _stream(args, inputs, start, settings, [_read("--input", args.input), ("--prefix-file", args.prefix_file),
                                                ("--checkpoint", path), ("--shortlist", args.shortlist)])


def _load_shortlist(path: str | None, translator: Translator) -> Shortlist | None:
    config = translator.model.config
    return None if path is None else Shortlist.load(path, config.vocab_size, config.eos_id)


def _translate_chunk(translator: Translator, shortlist: Shortlist | None, args: argparse.Namespace, first: int,
                     rows: list[tuple[str, ...]]) -> ChunkOutput:
    """Translates a chunk of rows (a source line, and its prefix with --prefix-file) starting at input line `first`
    (from 0) -> its output lines as --output-format says."""
    sources = [row[0] for row in rows]
    results = translator.hypotheses(
        sources, batch_tokens=args.batch_tokens,
        on_truncated=_report_truncation("translate", args.input or "stdin", first),
        target_prefix=None if args.prefix_file is None else [row[1] for row in rows], first_line=first + 1,
        return_scores=args.output_format == "jsonl", return_attention=args.print_alignment, beam_size=args.beam,
        length_penalty=args.length_penalty, length_penalty_form=args.length_penalty_form, n_best=args.n_best,
        sampling_topk=args.sampling_topk, sampling_topp=args.sampling_topp,
        sampling_temperature=args.sampling_temperature, seed=args.seed,
        no_repeat_ngram_size=args.no_repeat_ngram_size, repetition_penalty=args.repetition_penalty,
        shortlist=shortlist)
    translated = [hypotheses for source, hypotheses in zip(sources, results) if source.strip()]
    tokens = sum(len(result.tokens) + 1 for hypotheses in translated for result in hypotheses)  # EOS included
    return ChunkOutput(format_results(results, first, args.output_format, args.print_alignment), len(translated),
                       tokens)


# score's options that shape its output: a resumed run must have the same (--checkpoint and --targets too).
SCORE_SETTINGS = ("compute_type", "tokens")


def _run_score(args: argparse.Namespace) -> None:
    device = _inference_device(args.device)
    path = _newest_checkpoint(args)
    if not path.exists():  # now: the model loads only once a first chunk is read
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if args.input is None and args.targets is None:
        raise ValueError("--input and --targets both read standard input: give one of them as a file")
    settings = {"--" + name.replace("_", "-"): getattr(args, name) for name in SCORE_SETTINGS}
    settings |= {"--checkpoint": str(path.resolve()),
                 "--targets": "stdin" if args.targets is None else str(Path(args.targets).resolve())}

    def start() -> ChunkFunction:
        translator = load_translator(path, device, args.compute_type)
        return functools.partial(_score_chunk, translator, args)

    with contextlib.ExitStack() as stack:
        inputs = [_line_input(stack, "--input", args.input), _line_input(stack, "--targets", args.targets)]
        _stream(args, inputs, start, settings, [_read("--input", args.input), _read("--targets", args.targets),
                                                ("--checkpoint", path)])


def _score_chunk(translator: Translator, args: argparse.Namespace, first: int,
                 rows: list[tuple[str, ...]]) -> ChunkOutput:
    """Scores a chunk of (source, target) rows starting at input line `first` (from 0) -> its output lines."""
    lines, tokens = _score_lines(translator, rows, args.tokens, args.batch_tokens, first)
    return ChunkOutput(lines, len(rows), tokens)


def _score_lines(translator: Translator, pairs: list[tuple[str, ...]], with_tokens: bool, batch_tokens: int,
                 first: int = 0) -> tuple[list[str], int]:
    """(source, target) lines, the first being input line `first` (from 0) -> (one output line each:
    `total<TAB>normalized`, and with_tokens a third column of each token's log-probability (EOS last),
    space-separated; the tokens scored)."""
    results = translator.score([pair[0] for pair in pairs], [pair[1] for pair in pairs], batch_tokens=batch_tokens,
                               first_line=first + 1)
    lines = ["\t".join([f"{result.total:.6f}", f"{result.normalized:.6f}"]
                       + ([" ".join(f"{value:.6f}" for value in result.token_scores)] if with_tokens else []))
             for result in results]
    return lines, sum(len(result.token_scores) for result in results)


def _run_evaluate(args: argparse.Namespace) -> None:
    _evaluate(_newest_checkpoint(args), None if args.data_dir is None else Path(args.data_dir), args.split,
              args.src_lang, args.tgt_lang, args.beam, args.length_penalty, _inference_device(args.device),
              None if args.output is None else Path(args.output), args.max_sentences, args.length_penalty_form,
              args.compute_type, args.shortlist, args.batch_tokens)


def _run_shortlist(args: argparse.Namespace) -> None:
    path = _newest_checkpoint(args)
    _check_output(args.output, [("--source", args.source), ("--target", args.target), ("--checkpoint", path)],
                  text=False)
    _refuse_run_checkpoint_name(Path(args.output), "a shortlist", "shortlist.safetensors")
    translator = load_translator(path, "cpu")
    pairs = read_parallel(Path(args.source), Path(args.target))
    if args.max_sentences > 0:
        pairs = pairs[:args.max_sentences]
    start = time.perf_counter()
    sources = translator.source_tokenizer.encode([pair[0] for pair in pairs])
    targets = translator.target_tokenizer.encode([pair[1] for pair in pairs])
    config = translator.model.config
    shortlist = build_shortlist(zip(sources, targets), config.vocab_size, config.vocab_size, config.eos_id,
                                (config.pad_id, config.bos_id), args.per_source, args.always)
    shortlist.save(args.output)
    print(f"wrote {args.output}: {len(pairs)} sentence pairs, up to {args.per_source} target pieces per source piece "
          f"and {len(shortlist.always)} always, of a vocabulary of {config.vocab_size} "
          f"({time.perf_counter() - start:.1f} s)")


def _refuse_run_checkpoint_name(output: Path, what: str, example: str) -> None:
    """Refuses an --output named as a training run's own checkpoints, which `what` would replace or pass for."""
    if checkpoint.is_step_checkpoint_name(output):
        raise ValueError(f"--output {output} is named as a training step's checkpoint, which --resume would take for "
                         f"the newest, and {what} cannot resume: choose another name ({example})")
    if output.name == checkpoint.BEST_NAME:
        raise ValueError(f"--output {output} is named as a run's best checkpoint, which it would replace: choose "
                         f"another name ({example})")


def _run_average(args: argparse.Namespace) -> None:
    paths = [Path(p) for p in args.inputs] if args.inputs else checkpoint.list_checkpoints(Path(args.out_dir))
    # --inputs names what to average: all of them unless --last is given too.
    last = args.last if args.last is not None else len(paths) if args.inputs else 5
    if last < 1:
        raise ValueError(f"--last must be >= 1, got {last}")
    source = "--inputs" if args.inputs else str(args.out_dir)
    if not paths:
        raise FileNotFoundError(f"no checkpoint_*.pt to average in {source}")
    if len(paths) < last:
        print(f"fastformer average: warning: --last {last} asks for {last} checkpoints, but {source} has "
              f"only {len(paths)}: averaging {len(paths)}", file=sys.stderr)
    paths = paths[-last:]
    resolved = [path.resolve() for path in paths]
    twice = next((path for index, path in enumerate(paths) if resolved[index] in resolved[:index]), None)
    if twice is not None:
        raise ValueError(f"--inputs names {twice} twice: each checkpoint is averaged once")
    _check_output(args.output, [(source, path) for path in paths], text=False, parent_made=True)
    output = Path(args.output) if args.output else Path(args.out_dir) / "checkpoint_average.pt"
    _refuse_run_checkpoint_name(output, "an average", "checkpoint_average.pt")
    checkpoint.save_checkpoint(checkpoint.average_checkpoints(paths), output)
    noun = "checkpoint" if len(paths) == 1 else "checkpoints"
    print(f"averaged {len(paths)} {noun} ({paths[0].name} .. {paths[-1].name}) into {output}")


def _run_export(args: argparse.Namespace) -> None:
    source = _newest_checkpoint(args)
    if source.is_dir():
        raise ValueError(f"{source} is a directory: export takes a fastformer checkpoint (a Marian model converts "
                         "with CTranslate2's own ct2-transformers-converter)")
    # A model fine-tuned from a Marian one keeps its two sentencepiece models, whose joint vocabulary both sides share.
    output = Path(args.output)
    # Replacing an earlier export is the usual case; writing over other files (a Marian model's config.json, say)
    # is done only when asked.
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file: export writes a CTranslate2 model directory")
    if output.is_dir() and any(output.iterdir()) and not (output / "model.bin").is_file() and not args.force:
        raise ValueError(f"--output {output} holds files but no CTranslate2 model (model.bin): export would write over "
                         f"them; pass --force to, or choose an empty or new directory")
    model, tokenizers = load_checkpoint_tokenizers(source)
    written = export.to_ctranslate2(model, tokenizers.source, Path(args.output), quantization=args.quantization)
    print(f"exported {source} to {written} (CTranslate2, {args.quantization}); its inputs are the tokenizer's pieces")


def _run_plot(args: argparse.Namespace) -> None:
    out_dirs = list(dict.fromkeys(Path(out_dir) for out_dir in args.out_dir))  # a run named twice is one run
    output = plot_curves(out_dirs, out_dirs[0] / CURVES_FILE)
    print(f"drew the curves of {len(out_dirs)} run{'s' if len(out_dirs) > 1 else ''} into {output}")


def _add_model_options(parser: argparse.ArgumentParser, batch_help: str) -> None:
    """The options of every command that runs a trained model: which model, where and in which type, and batches."""
    parser.add_argument("--checkpoint", help="a checkpoint file or a Marian (OPUS-MT) model directory in the "
                        "transformers layout (default: the newest checkpoint in --out-dir)")
    parser.add_argument("--out-dir", default="runs/demo", help="the training run's directory")
    parser.add_argument("--batch-tokens", type=int, default=4096, help=batch_help)
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--compute-type", choices=COMPUTE_TYPES,
                        help="the linear layers' type: on the CPU float32, bfloat16 or int8, on CUDA float16 or "
                        "bfloat16 (float32 too), auto: the fastest this machine has (default: the checkpoint's dtype)")


def _add_inference_options(parser: argparse.ArgumentParser, beam_help: str = "beam size (1: greedy)") -> None:
    _add_model_options(parser, "source tokens per translation batch")
    parser.add_argument("--beam", type=int, default=BEAM, help=beam_help)
    parser.add_argument("--length-penalty", type=float, default=0.6,
                        help="alpha of the length penalty (0: none)")
    parser.add_argument("--length-penalty-form", choices=LENGTH_PENALTY_FORMS, default="gnmt",
                        help="gnmt: divide by ((5 + |Y|) / 6) ** alpha; length: by |Y| ** alpha (fairseq, "
                        "transformers, CTranslate2, Marian)")
    parser.add_argument("--shortlist", help="a vocabulary shortlist (`fastformer shortlist` builds one): each batch "
                        "computes the logits of its sources' likely target pieces only (CPU)")


def _add_streaming_options(parser: argparse.ArgumentParser, input_help: str, output_help: str) -> None:
    """The options of a command that streams its input through _stream."""
    parser.add_argument("--input", help=input_help)
    parser.add_argument("--output", help=output_help)
    parser.add_argument("--chunk-lines", type=int, default=2000,
                        help="input lines read, processed and written at a time (bounds memory; a chunk is sorted by "
                        "length within itself)")
    parser.add_argument("--resume", action="store_true",
                        help="continue an interrupted run: keep the lines --output holds (its .progress file says "
                        "how many) and go on after them; refused if the input or the options changed")


def _add_translate_options(parser: argparse.ArgumentParser) -> None:
    """translate's output and its search options beyond the beam (CTranslate2's names)."""
    parser.add_argument("--output-format", choices=OUTPUT_FORMATS, default="text",
                        help="text: the best translation per line; jsonl: one JSON object per hypothesis, "
                        '{"line", "rank", "text", "score"} (and "alignment")')
    parser.add_argument("--n-best", type=int, default=1,
                        help="hypotheses per line (jsonl only; <= --beam, or samples with --sampling-topk != 1)")
    parser.add_argument("--print-alignment", action="store_true",
                        help="add fairseq's hard alignment, source-target piece indices \"i-j ...\" from the "
                        "cross-attention (text: after a tab)")
    parser.add_argument("--prefix-file", help="a file with one target prefix per input line (an empty line: none), "
                        "forced before the search goes on")
    parser.add_argument("--sampling-topk", type=int, default=1,
                        help="sample from the k most likely tokens (1: no sampling, 0: the whole vocabulary), "
                        "with --beam 1")
    parser.add_argument("--sampling-topp", type=float, default=1.0,
                        help="sample from the smallest set of most likely tokens whose probability reaches p")
    parser.add_argument("--sampling-temperature", type=float, default=1.0, help="divides the logits when sampling")
    parser.add_argument("--seed", type=int, default=0,
                        help="the sampling seed (a sentence's samples depend on it and its tokens only)")
    parser.add_argument("--no-repeat-ngram-size", type=int, default=0,
                        help="never repeat an n-gram of this size in a hypothesis (0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide an already generated token's positive logit by it, multiply a negative one "
                        "(1: off)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastformer", description=__doc__.splitlines()[0], **HELP_FORMAT)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train the tiny preset on the bundled corpus, then report test BLEU",
                               **HELP_FORMAT)
    _add_train_options(demo, DEMO_DEFAULTS, flags={"max_minutes": "--minutes"})
    demo.add_argument("--max-sentences", type=int, default=0, help="score the first N test sentences (0: all)")
    demo.set_defaults(run=_run_demo)

    train_parser = commands.add_parser("train", help="train a model (the paper's recipe by default)", **HELP_FORMAT)
    _add_train_options(train_parser, {})
    train_parser.set_defaults(run=_run_train)

    prepare = commands.add_parser("prepare", help="tokenize a corpus once for every later run (train does it itself "
                                  "when needed)", **HELP_FORMAT)
    _add_train_options(prepare, {}, only=PREPARE_OPTIONS)
    prepare.set_defaults(run=_run_prepare)

    translate = commands.add_parser("translate", help="translate lines from stdin (or --input) to stdout (or "
                                    "--output), chunk by chunk; an empty line gives an empty line", **HELP_FORMAT)
    # Sampling draws with beam 1, so there --beam defaults to 1: `--sampling-topk 10` alone samples.
    _add_inference_options(translate, f"beam size (1: greedy; default: {BEAM}, or 1 when sampling)")
    translate.set_defaults(beam=None)
    _add_streaming_options(translate, "a file of source sentences (default: stdin)",
                           "where to write translations (default: stdout)")
    _add_translate_options(translate)
    translate.set_defaults(run=_run_translate)

    score = commands.add_parser("score", help="score given translations: per line pair, the sum of the target's "
                                "log-probabilities and that sum per token (EOS included), tab-separated, chunk by "
                                "chunk",
                                **HELP_FORMAT)
    _add_model_options(score, "source tokens per scoring batch")
    _add_streaming_options(score, "a file of source sentences (default: stdin)",
                           "where to write the scores (default: stdout)")
    score.add_argument("--targets", required=True, help="a file of target sentences, one per source line")
    score.add_argument("--tokens", action="store_true",
                       help="a third column: each target token's log-probability, space-separated, EOS last")
    score.set_defaults(run=_run_score)

    shortlist = commands.add_parser("shortlist", help="build a vocabulary shortlist for --shortlist from a parallel "
                                    "corpus: each source piece's likely target pieces", **HELP_FORMAT)
    shortlist.add_argument("--checkpoint", help="the model whose tokenizers it is for (default: the newest "
                           "checkpoint in --out-dir)")
    shortlist.add_argument("--out-dir", default="runs/demo", help="the training run's directory")
    shortlist.add_argument("--source", required=True, help="source sentences, one per line")
    shortlist.add_argument("--target", required=True, help="their translations, line by line")
    shortlist.add_argument("--output", required=True, help="the shortlist file to write")
    shortlist.add_argument("--per-source", type=int, default=20,
                           help="target pieces kept per source piece (by their Dice coefficient over the corpus)")
    shortlist.add_argument("--always", type=int, default=100, help="the most frequent target pieces, always kept")
    shortlist.add_argument("--max-sentences", type=int, default=0, help="use the first N sentence pairs (0: all)")
    shortlist.set_defaults(run=_run_shortlist)

    evaluate_parser = commands.add_parser("evaluate", help="translate a test split and print sacreBLEU",
                                          **HELP_FORMAT)
    _add_inference_options(evaluate_parser)
    evaluate_parser.add_argument("--data-dir", help="corpus directory (default: the bundled corpus)")
    evaluate_parser.add_argument("--split", default="test", choices=("valid", "test"),
                                 help="valid: newstest2013 or valid.*; test: newstest2014 or test.*")
    evaluate_parser.add_argument("--src-lang", default="en", help="source language: the files' suffix")
    evaluate_parser.add_argument("--tgt-lang", default="de", help="target language: the files' suffix")
    evaluate_parser.add_argument("--output", help="also write the translations to this file")
    evaluate_parser.add_argument("--max-sentences", type=int, default=0, help="score the first N sentences (0: all)")
    evaluate_parser.set_defaults(run=_run_evaluate)

    export_parser = commands.add_parser("export", help="write a checkpoint as a CTranslate2 model directory",
                                        **HELP_FORMAT)
    export_parser.add_argument("--checkpoint", help="a checkpoint file (default: the newest in --out-dir)")
    export_parser.add_argument("--out-dir", default="runs/demo", help="the training run's directory")
    export_parser.add_argument("--output", required=True, help="the CTranslate2 model directory to write")
    export_parser.add_argument("--quantization", default="float32", choices=export.QUANTIZATIONS,
                               help="how CTranslate2 stores the weights")
    export_parser.add_argument("--force", action="store_true",
                               help="write into --output even where it holds files that are not a CTranslate2 model")
    export_parser.set_defaults(run=_run_export)

    average = commands.add_parser("average", help="average the last N checkpoints of a run into one", **HELP_FORMAT)
    average.add_argument("--out-dir", default="runs/demo", help="the training run's directory")
    average.add_argument("--last", type=int, help="how many of the newest checkpoints to average (default: 5 of "
                         "--out-dir's, or every one of --inputs)")
    average.add_argument("--inputs", nargs="+", help="checkpoint files, all averaged unless --last is given "
                         "(default: those in --out-dir)")
    average.add_argument("--output", help="the averaged checkpoint (default: <out-dir>/checkpoint_average.pt)")
    average.set_defaults(run=_run_average)

    plot = commands.add_parser("plot", help=f"draw the curves of training runs (their metrics.jsonl) into "
                               f"OUT_DIR/{CURVES_FILE}", **HELP_FORMAT)
    plot.add_argument("--out-dir", action="append", required=True,
                      help=f"a training run's directory; repeat it to overlay runs ({CURVES_FILE} goes to the first)")
    plot.set_defaults(run=_run_plot)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Runs a command; a user error (bad option or input, missing or unreadable file, a busy out-dir, a diverged or
    unsavable run) ends it with one line on stderr and exit status 1, a training run stopped by SIGTERM or SIGINT
    with exit status run_control.EXIT_STOPPED. A torchrun worker ends in _exit_torchrun_worker."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.command in ("translate", "score"):  # "-": standard input or output, as Unix tools take it
        for name in ("input", "output", "targets"):
            if getattr(args, name, None) == "-":
                setattr(args, name, None)
    try:
        args.run(args)
    except BrokenPipeError:  # what read stdout has gone (`| head`): end quietly, as Unix tools do on SIGPIPE
        _quiet_stdout()
        raise SystemExit(128 + signal.SIGPIPE) from None
    except (ValueError, OSError, ImportError) as error:
        raise SystemExit(f"fastformer {args.command}: error: {error}") from None
    except (RuntimeError, MemoryError) as error:
        if not _out_of_memory(error):
            raise
        raise SystemExit(f"fastformer {args.command}: error: out of memory ({str(error).splitlines()[0]}): a smaller "
                         "--batch-tokens, or --beam, needs less") from None
    except KeyboardInterrupt:  # Ctrl-C outside the loops that stop on it (preparing a corpus, loading a model)
        print(f"fastformer {args.command}: interrupted", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            _exit_torchrun_worker(sys.exc_info()[1])


def _out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed (torch's CPU allocator, CUDA, Python's own)."""
    return (isinstance(error, (MemoryError, torch.OutOfMemoryError))
            or "DefaultCPUAllocator: can't allocate memory" in str(error))


def _quiet_stdout() -> None:
    """Points stdout at /dev/null, so that the interpreter's last flush of what it holds raises no second error."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # a stand-in stdout without a file descriptor
        pass


def _exit_torchrun_worker(error: BaseException | None) -> typing.NoReturn:
    """Ends the process as Python would on `error` (None: success), but without finalizing the interpreter.

    Once DDP has been built, torch 2.13 keeps the default gloo group, and its worker threads, alive past
    destroy_process_group (also when DDP is given a group of its own). A worker that frees a finished collective's
    Python-owned tensor after finalization began cannot take the GIL, and the rank aborts with "terminate called
    without an active exception": a run that trained and saved, reported failed by torchrun (seen in CI; here twice
    in about 400 two-rank launches on a loaded CPU, the core dump showing a gloo worker freeing an AsyncWork's
    tensors during Py_FinalizeEx). Nothing is left to finalize: the group is destroyed, checkpoints are closed, and
    stdout/stderr are flushed here."""
    if error is None:
        status = 0
    elif isinstance(error, SystemExit):
        status = error.code if isinstance(error.code, int) else int(error.code is not None)
        if error.code is not None and not isinstance(error.code, int):
            print(error.code, file=sys.stderr)
    else:
        traceback.print_exception(error)
        status = 128 + signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
