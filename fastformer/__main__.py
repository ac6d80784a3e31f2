"""The command line: `python -m fastformer {demo,train,translate,evaluate,average}` (also the `fastformer` script).

`python -m fastformer demo` is the whole job on the bundled corpus: train the tiny preset (3 minutes by default,
`--minutes N`), translate the held-out test split with beam search, print sacreBLEU and throughput. It runs unchanged
under torchrun and on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
import typing
from pathlib import Path

import torch
import torch.distributed as dist

from fastformer import checkpoint, evaluate
from fastformer.search_rules import LENGTH_PENALTY_FORMS
from fastformer.data import find_split, read_lines, read_parallel
from fastformer.train import TrainOptions, TrainResult, train
from fastformer.translator import load_translator

# The demo fits the bundled corpus and a few CPU minutes: small updates, so that it takes many steps, with a short
# warmup and a raised peak learning rate. On a 2-core CPU (about 30k target tokens/s, 12 steps/s) its validation
# BLEU passes 70 after 500 steps and 95 after 1500; the default 3 minutes end near 99 on the test split.
DEMO_DEFAULTS = dict(out_dir="runs/demo", preset="tiny", batch_tokens=1500, update_tokens=1500, warmup=500,
                     lr_scale=2.0, max_steps=1_000_000, max_minutes=3.0, log_every=100, valid_every=500,
                     valid_bleu_sentences=100, save_every=500)


def _add_train_options(parser: argparse.ArgumentParser, defaults: dict, flags: dict[str, str] | None = None) -> None:
    """One flag per TrainOptions field (--batch-tokens for batch_tokens, unless `flags` names another), with the
    field's type and default."""
    hints = typing.get_type_hints(TrainOptions)
    for option in dataclasses.fields(TrainOptions):
        flag = (flags or {}).get(option.name, "--" + option.name.replace("_", "-"))
        default = defaults.get(option.name, option.default)
        kind = hints[option.name]
        if kind is bool:
            parser.add_argument(flag, dest=option.name, action="store_true", default=default)
            continue
        if isinstance(kind, types.UnionType):  # X | None: the flag takes an X
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        parser.add_argument(flag, dest=option.name, type=kind, default=default, help=f"default: {default}")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete out_dir's checkpoints first (else they stop a fresh run)")


def _train_options(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(**{option.name: getattr(args, option.name) for option in dataclasses.fields(TrainOptions)})


def _is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _check_out_dir(options: TrainOptions, overwrite: bool) -> None:
    """A fresh run must not mix with an old one's checkpoints: resume it, or overwrite it explicitly."""
    out_dir = Path(options.out_dir)
    old = checkpoint.list_checkpoints(out_dir)
    if options.resume or not old:
        return
    if not overwrite:
        raise SystemExit(f"{out_dir} already holds checkpoints ({old[-1].name}): pass --resume to continue that "
                         f"run, --overwrite to start over, or another --out-dir")
    # Every rank sees the old files; rank 0 alone deletes them (the fresh run retrains the vocabulary).
    if os.environ.get("RANK", "0") == "0":
        for path in old:
            path.unlink(missing_ok=True)


def _run_train(args: argparse.Namespace) -> TrainResult:
    options = _train_options(args)
    _check_out_dir(options, args.overwrite)
    result = train(options)
    if _is_main_process():
        print(f"trained {result.step} steps: {result.tokens_per_second:,.0f} target tokens/s, final train loss "
              f"{result.train_loss:.3f}; checkpoint {result.checkpoint}")
    return result


def _run_demo(args: argparse.Namespace) -> None:
    result = _run_train(args)
    if _is_main_process():
        _evaluate(result.checkpoint, None if args.data_dir is None else Path(args.data_dir), "test",
                  args.src_lang, args.tgt_lang, beam_size=4, length_penalty=0.6, device=_inference_device(args.device),
                  output=None, max_sentences=args.max_sentences)


def _inference_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def _evaluate(checkpoint_path: Path, data_dir: Path | None, split: str, src_lang: str, tgt_lang: str,
              beam_size: int, length_penalty: float, device: str, output: Path | None, max_sentences: int = 0,
              length_penalty_form: str = "gnmt") -> float:
    """Translates a split (its first max_sentences, if > 0), prints cased sacreBLEU (13a and intl) with signatures;
    -> the 13a score."""
    files = find_split(data_dir, split, src_lang, tgt_lang)
    pairs = read_parallel(files.src, files.tgt)
    if max_sentences > 0:
        pairs = pairs[:max_sentences]
    translator = load_translator(checkpoint_path, device)
    start = time.perf_counter()
    hypotheses = translator.translate([pair[0] for pair in pairs], beam_size=beam_size, length_penalty=length_penalty,
                                       length_penalty_form=length_penalty_form)
    elapsed = time.perf_counter() - start
    if output is not None:
        output.write_text("".join(line + "\n" for line in hypotheses), encoding="utf-8")
    generated = sum(len(ids) + 1 for ids in translator.target_tokenizer.encode(hypotheses))
    print(f"translated {len(pairs)} sentences of {files.src} on {device} in {elapsed:.1f}s "
          f"({len(pairs) / elapsed:.1f} sentences/s, {generated / elapsed:,.0f} generated tokens/s, beam {beam_size})")
    results = evaluate.bleu(hypotheses, [pair[1] for pair in pairs])
    for _, line in results:
        print(line)
    return results[0][0]


def _newest_checkpoint(args: argparse.Namespace) -> Path:
    if args.checkpoint is not None:
        return Path(args.checkpoint)
    found = checkpoint.list_checkpoints(Path(args.out_dir))
    if not found:
        raise SystemExit(f"no checkpoint_*.pt in {args.out_dir}: pass --checkpoint")
    return found[-1]


def _run_translate(args: argparse.Namespace) -> None:
    translator = load_translator(_newest_checkpoint(args), _inference_device(args.device))
    sentences = read_lines(Path(args.input)) if args.input else [line.rstrip("\n") for line in sys.stdin]
    translations = translator.translate(sentences, beam_size=args.beam, length_penalty=args.length_penalty,
                                        batch_tokens=args.batch_tokens,
                                        length_penalty_form=args.length_penalty_form)
    text = "".join(line + "\n" for line in translations)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


def _run_evaluate(args: argparse.Namespace) -> None:
    _evaluate(_newest_checkpoint(args), None if args.data_dir is None else Path(args.data_dir), args.split,
              args.src_lang, args.tgt_lang, args.beam, args.length_penalty, _inference_device(args.device),
              None if args.output is None else Path(args.output), args.max_sentences, args.length_penalty_form)


def _run_average(args: argparse.Namespace) -> None:
    paths = [Path(p) for p in args.inputs] if args.inputs else checkpoint.list_checkpoints(Path(args.out_dir))
    if args.last < 1:
        raise SystemExit(f"--last must be >= 1, got {args.last}")
    paths = paths[-args.last:]
    if not paths:
        raise SystemExit(f"no checkpoints to average in {args.out_dir}")
    output = Path(args.output) if args.output else Path(args.out_dir) / "checkpoint_average.pt"
    checkpoint.save_checkpoint(checkpoint.average_checkpoints(paths), output)
    print(f"averaged {len(paths)} checkpoints ({paths[0].name} .. {paths[-1].name}) into {output}")


def _add_inference_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="a checkpoint file or a Marian (OPUS-MT) model directory in the "
                        "transformers layout (default: the newest checkpoint in --out-dir)")
    parser.add_argument("--out-dir", default="runs/demo", help="the training run's directory")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--length-penalty", type=float, default=0.6)
    parser.add_argument("--length-penalty-form", choices=LENGTH_PENALTY_FORMS, default="gnmt",
                        help="gnmt: sum / ((5 + |Y|) / 6) ** alpha; length: sum / |Y| ** alpha (fairseq, transformers)")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--device", default="auto")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastformer", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train the tiny preset on the bundled corpus, then report test BLEU")
    _add_train_options(demo, DEMO_DEFAULTS, flags={"max_minutes": "--minutes"})
    demo.add_argument("--max-sentences", type=int, default=0, help="score the first N test sentences (0: all)")
    demo.set_defaults(run=_run_demo)

    train_parser = commands.add_parser("train", help="train a model (the paper's recipe by default)")
    _add_train_options(train_parser, {})
    train_parser.set_defaults(run=_run_train)

    translate = commands.add_parser("translate", help="translate lines from stdin (or --input) to stdout")
    _add_inference_options(translate)
    translate.add_argument("--input", help="a file of source sentences (default: stdin)")
    translate.add_argument("--output", help="where to write translations (default: stdout)")
    translate.set_defaults(run=_run_translate)

    evaluate_parser = commands.add_parser("evaluate", help="translate a test split and print sacreBLEU")
    _add_inference_options(evaluate_parser)
    evaluate_parser.add_argument("--data-dir", help="corpus directory (default: the bundled corpus)")
    evaluate_parser.add_argument("--split", default="test", choices=("valid", "test"))
    evaluate_parser.add_argument("--src-lang", default="en")
    evaluate_parser.add_argument("--tgt-lang", default="de")
    evaluate_parser.add_argument("--output", help="also write the translations to this file")
    evaluate_parser.add_argument("--max-sentences", type=int, default=0, help="score the first N sentences (0: all)")
    evaluate_parser.set_defaults(run=_run_evaluate)

    average = commands.add_parser("average", help="average the last N checkpoints of a run into one")
    average.add_argument("--out-dir", default="runs/demo")
    average.add_argument("--last", type=int, default=5)
    average.add_argument("--inputs", nargs="*", help="checkpoint files (default: those in --out-dir)")
    average.add_argument("--output", help="default: <out-dir>/checkpoint_average.pt")
    average.set_defaults(run=_run_average)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"fastformer {args.command}: error: {error}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
