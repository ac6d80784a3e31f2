"""fastformer: train, translate, evaluate and average Transformer translation models (the paper's recipe).

The command line, `fastformer {demo,train,prepare,translate,score,evaluate,average,export,plot}` (also
`python -m fastformer`).
`fastformer demo` is the whole job on the bundled corpus: train the tiny preset a fixed number of updates, translate
the held-out test split with beam search, print sacreBLEU and throughput. It runs unchanged under torchrun and on a
GPU. `fastformer prepare` tokenizes a corpus once for every later run (train does it itself when needed).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from fastformer.data import decode_sentences, find_split, read_parallel
from fastformer.decoding.compiled import COMPUTE_TYPES
from fastformer.decoding.rules import LENGTH_PENALTY_FORMS
from fastformer.training import run_control
from fastformer.training.curves import CURVES_FILE, plot_curves
from fastformer.training.init_from import load_initial_model
from fastformer.training.run_corpus import prepare_run_corpora
from fastformer.training.options import TrainOptions
from fastformer.training.trainer import TrainResult, check_run, process_rank, train
from fastformer.translation import evaluate, export
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


def _check_out_dir(options: TrainOptions, overwrite: bool) -> None:
    """A fresh run must not mix with an old one's checkpoints: resume it, or overwrite it explicitly."""
    out_dir = Path(options.out_dir)
    best = checkpoint.best_checkpoint_path(out_dir)
    old = checkpoint.list_checkpoints(out_dir) + ([best] if best.is_file() else [])
    if options.resume or not old:
        return
    if not overwrite:
        raise ValueError(f"{out_dir} already holds checkpoints ({old[-1].name}): pass --resume to continue that "
                         f"run, --overwrite to start over, or another --out-dir")
    # Every rank sees the old files; rank 0 alone deletes them (the fresh run retrains the vocabulary).
    if process_rank() == 0:
        for path in old:
            path.unlink(missing_ok=True)


def _run_train(args: argparse.Namespace) -> TrainResult:
    """Trains (rank 0 holding out_dir's lock); a run stopped by a signal ends here with its resume command and exit
    status run_control.EXIT_STOPPED."""
    options = _train_options(args)
    check_run(options)
    with run_control.out_dir_lock(Path(options.out_dir), process_rank()):
        _check_out_dir(options, args.overwrite)
        result = train(options)
    if result.stopped_by is not None:
        if process_rank() == 0:
            print(run_control.stopped_message(result.step, result.checkpoint, result.stopped_by, args.argv,
                                              dist.get_world_size() if dist.is_initialized() else 1), file=sys.stderr)
        raise SystemExit(run_control.EXIT_STOPPED)
    if process_rank() == 0:
        if result.out_of_patience:
            print(_patience_message(args.command, options, result))
        print(f"trained {result.step} steps: {result.tokens_per_second:,.0f} target tokens/s, final train loss "
              f"{result.train_loss:.3f}; checkpoint {result.checkpoint}")
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
    for corpus in prepare_run_corpora(options, None if initial is None else initial.tokenizers):
        print(f"prepared corpus: {corpus.path} ({len(corpus.train):,} training pairs, vocabulary "
              f"{corpus.tokenizers.vocab_size:,})")


def _run_demo(args: argparse.Namespace) -> None:
    result = _run_train(args)
    if process_rank() == 0:
        _evaluate(result.checkpoint, None if args.data_dir is None else Path(args.data_dir), "test",
                  args.src_lang, args.tgt_lang, beam_size=4, length_penalty=0.6, device=_inference_device(args.device),
                  output=None, max_sentences=args.max_sentences)


def _inference_device(device: str) -> torch.device:
    return evaluate.resolve_device(device)


def _report_truncation(command: str, source: str) -> OnTruncated:
    """-> an on_truncated callback that warns on stderr, naming the line of `source` that was cut."""
    def report(index: int, n_tokens: int, limit: int) -> None:
        print(f"fastformer {command}: warning: line {index + 1} of {source} has {n_tokens} source tokens, more than "
              f"the model's limit of {limit}: only its first {limit} were translated", file=sys.stderr)
    return report


def _evaluate(checkpoint_path: Path, data_dir: Path | None, split: str, src_lang: str, tgt_lang: str,
              beam_size: int, length_penalty: float, device: str, output: Path | None, max_sentences: int = 0,
              length_penalty_form: str = "gnmt", compute_type: str | None = None) -> float:
    """Translates a split (its first max_sentences, if > 0), prints cased sacreBLEU (13a and intl) with signatures;
    -> the 13a score."""
    files = find_split(data_dir, split, src_lang, tgt_lang)
    pairs = read_parallel(files.src, files.tgt)
    if max_sentences > 0:
        pairs = pairs[:max_sentences]
    translator = load_translator(checkpoint_path, device, compute_type)
    start = time.perf_counter()
    hypotheses = translator.translate([pair[0] for pair in pairs], beam_size=beam_size, length_penalty=length_penalty,
                                       length_penalty_form=length_penalty_form,
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


def _read_sentences(input_path: str | None) -> tuple[list[str], str]:
    """--input (or stdin) -> (its lines, empty ones kept, the name messages use)."""
    if input_path is None:
        return decode_sentences(sys.stdin.buffer, "stdin"), "stdin"
    if not Path(input_path).is_file():
        raise FileNotFoundError(f"input file not found: {input_path}")
    with open(input_path, "rb") as file:
        return decode_sentences(file, input_path), input_path


def _run_translate(args: argparse.Namespace) -> None:
    device = _inference_device(args.device)
    # Read the input first: a decoding error must not wait for (or follow) loading the model.
    sentences, source = _read_sentences(args.input)
    translator = load_translator(_newest_checkpoint(args), device, args.compute_type)
    translations = translator.translate(sentences, beam_size=args.beam, length_penalty=args.length_penalty,
                                        batch_tokens=args.batch_tokens, length_penalty_form=args.length_penalty_form,
                                        on_truncated=_report_truncation("translate", source))
    text = "".join(line + "\n" for line in translations)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


def _run_score(args: argparse.Namespace) -> None:
    # Read both files first: a decoding error or a count mismatch must not wait for loading the model.
    sources, source_name = _read_sentences(args.input)
    targets, target_name = _read_sentences(args.targets)
    if len(sources) != len(targets):
        raise ValueError(f"{source_name} has {len(sources)} lines but {target_name} has {len(targets)}: score needs "
                         "one target line per source line")
    translator = load_translator(_newest_checkpoint(args), _inference_device(args.device), args.compute_type)
    lines = _score_lines(translator, list(zip(sources, targets)), args.tokens, args.batch_tokens)
    text = "".join(line + "\n" for line in lines)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


def _score_lines(translator: Translator, pairs: list[tuple[str, str]], with_tokens: bool,
                batch_tokens: int) -> list[str]:
    """(source, target) lines -> one output line each: `total<TAB>normalized`, and with_tokens a third column of each
    token's log-probability (EOS last), space-separated."""
    results = translator.score([source for source, _ in pairs], [target for _, target in pairs],
                               batch_tokens=batch_tokens)
    return ["\t".join([f"{result.total:.6f}", f"{result.normalized:.6f}"]
                      + ([" ".join(f"{value:.6f}" for value in result.token_scores)] if with_tokens else []))
            for result in results]


def _run_evaluate(args: argparse.Namespace) -> None:
    _evaluate(_newest_checkpoint(args), None if args.data_dir is None else Path(args.data_dir), args.split,
              args.src_lang, args.tgt_lang, args.beam, args.length_penalty, _inference_device(args.device),
              None if args.output is None else Path(args.output), args.max_sentences, args.length_penalty_form,
              args.compute_type)


def _run_average(args: argparse.Namespace) -> None:
    paths = [Path(p) for p in args.inputs] if args.inputs else checkpoint.list_checkpoints(Path(args.out_dir))
    if args.last < 1:
        raise ValueError(f"--last must be >= 1, got {args.last}")
    source = "--inputs" if args.inputs else str(args.out_dir)
    if not paths:
        raise FileNotFoundError(f"no checkpoint_*.pt to average in {source}")
    if len(paths) < args.last:
        print(f"fastformer average: warning: --last {args.last} asks for {args.last} checkpoints, but {source} has "
              f"only {len(paths)}: averaging {len(paths)}", file=sys.stderr)
    paths = paths[-args.last:]
    output = Path(args.output) if args.output else Path(args.out_dir) / "checkpoint_average.pt"
    checkpoint.save_checkpoint(checkpoint.average_checkpoints(paths), output)
    noun = "checkpoint" if len(paths) == 1 else "checkpoints"
    print(f"averaged {len(paths)} {noun} ({paths[0].name} .. {paths[-1].name}) into {output}")


def _run_export(args: argparse.Namespace) -> None:
    source = _newest_checkpoint(args)
    if source.is_dir():
        raise ValueError(f"{source} is a directory: export takes a fastformer checkpoint (a Marian model converts "
                         "with CTranslate2's own ct2-transformers-converter)")
    # A model fine-tuned from a Marian one keeps its two sentencepiece models, whose joint vocabulary both sides share.
    model, tokenizers = load_checkpoint_tokenizers(source)
    written = export.to_ctranslate2(model, tokenizers.source, Path(args.output), quantization=args.quantization)
    print(f"exported {source} to {written} (CTranslate2, {args.quantization}); its inputs are the tokenizer's pieces")


def _run_plot(args: argparse.Namespace) -> None:
    out_dirs = [Path(out_dir) for out_dir in args.out_dir]
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


def _add_inference_options(parser: argparse.ArgumentParser) -> None:
    _add_model_options(parser, "source tokens per translation batch")
    parser.add_argument("--beam", type=int, default=4, help="beam size (1: greedy)")
    parser.add_argument("--length-penalty", type=float, default=0.6,
                        help="alpha of the length penalty (0: none)")
    parser.add_argument("--length-penalty-form", choices=LENGTH_PENALTY_FORMS, default="gnmt",
                        help="gnmt: divide by ((5 + |Y|) / 6) ** alpha; length: by |Y| ** alpha (fairseq, "
                        "transformers, CTranslate2, Marian)")


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

    translate = commands.add_parser("translate", help="translate lines from stdin (or --input) to stdout; an empty "
                                    "line gives an empty line", **HELP_FORMAT)
    _add_inference_options(translate)
    translate.add_argument("--input", help="a file of source sentences (default: stdin)")
    translate.add_argument("--output", help="where to write translations (default: stdout)")
    translate.set_defaults(run=_run_translate)

    score = commands.add_parser("score", help="score given translations: per line pair, the sum of the target's "
                                "log-probabilities and that sum per token (EOS included), tab-separated",
                                **HELP_FORMAT)
    _add_model_options(score, "source tokens per scoring batch")
    score.add_argument("--input", required=True, help="a file of source sentences")
    score.add_argument("--targets", required=True, help="a file of target sentences, one per source line")
    score.add_argument("--output", help="where to write the scores (default: stdout)")
    score.add_argument("--tokens", action="store_true",
                       help="a third column: each target token's log-probability, space-separated, EOS last")
    score.set_defaults(run=_run_score)

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
    export_parser.set_defaults(run=_run_export)

    average = commands.add_parser("average", help="average the last N checkpoints of a run into one", **HELP_FORMAT)
    average.add_argument("--out-dir", default="runs/demo", help="the training run's directory")
    average.add_argument("--last", type=int, default=5, help="how many of the newest checkpoints to average")
    average.add_argument("--inputs", nargs="*", help="checkpoint files (default: those in --out-dir)")
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
    try:
        args.run(args)
    except (ValueError, OSError, ImportError) as error:
        raise SystemExit(f"fastformer {args.command}: error: {error}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            _exit_torchrun_worker(sys.exc_info()[1])


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
