"""A training run's corpora: their files, and their prepared (memory-mapped) form, made by rank 0 and opened by every
rank. The main corpus (--data-dir, or the bundled one) comes with its validation split and fixes the vocabulary; each
--extra-data corpus is prepared on its own with that vocabulary.

Rank 0 alone reads the text and prepares; the other ranks wait for it on a gloo group of their own whose timeout is
long enough for any preparation (the training group's timeout stays short, so a rank stuck in training is still
caught), then open the directories rank 0 names. So every rank maps the same files and no rank re-reads the corpus;
on several nodes the prepared directory must be on storage every node mounts (--prepared-dir).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from fastformer.data import LengthFilter, SplitFiles, find_split
from fastformer.data.prepared import (PreparedCorpus, PrepareSettings, default_prepared_dir, default_vocab_size,
                                      ensure_prepared)
from fastformer.data.reading import check_line_counts, count_lines
from fastformer.data.tokenizer import Tokenizers
from fastformer.training.options import TrainOptions

PREPARE_TIMEOUT = timedelta(hours=24)


def corpus_files(options: TrainOptions) -> dict[str, SplitFiles]:
    """The run's train and valid files: a missing one is an error before anything is written, except a valid split
    that a run without validation (--valid-every 0) does without."""
    data_dir = None if options.data_dir is None else Path(options.data_dir)
    files = {"train": find_split(data_dir, "train", options.src_lang, options.tgt_lang)}
    try:
        files["valid"] = find_split(data_dir, "valid", options.src_lang, options.tgt_lang)
    except FileNotFoundError:
        if options.valid_every:
            raise
    return files


def extra_corpus_files(options: TrainOptions) -> list[SplitFiles]:
    """The train files of each --extra-data corpus: a missing one is an error before anything is written."""
    return [find_split(Path(directory), "train", options.src_lang, options.tgt_lang)
            for directory in options.extra_data or ()]


def prepare_settings(options: TrainOptions, tokenizers: Tokenizers | None = None) -> PrepareSettings:
    """The run's preparation: with the tokenizers of --init-from's model, else with a vocabulary learned from it (with
    --tag-extra's tag reserved)."""
    length_filter = LengthFilter(options.min_len, options.max_len, options.max_ratio)
    if tokenizers is not None:
        return PrepareSettings(tokenizers.vocab_size, length_filter, tokenizers=tokenizers,
                               reserved=tokenizers.reserved)
    return PrepareSettings(options.vocab_size or default_vocab_size(options.data_dir), length_filter,
                           reserved=() if options.tag_extra is None else (options.tag_extra,))


def prepare_run_corpus(options: TrainOptions, tokenizers: Tokenizers | None = None) -> PreparedCorpus:
    """Prepares (or opens, if already prepared) the run's main corpus where --prepared-dir says, else in the cache;
    with tokenizers (--init-from's), encoded by them."""
    files, settings = corpus_files(options), prepare_settings(options, tokenizers)
    path = Path(options.prepared_dir) if options.prepared_dir else default_prepared_dir(files, settings)
    return ensure_prepared(files, settings, path, progress=not options.quiet)


def prepare_run_corpora(options: TrainOptions, tokenizers: Tokenizers | None = None) -> list[PreparedCorpus]:
    """The main corpus, then each --extra-data corpus encoded with its vocabulary (beside --prepared-dir as
    <dir>.extra<i>, else in the cache). The extra corpora's line counts are checked before anything is prepared."""
    extras = extra_corpus_files(options)
    for files in extras:
        check_line_counts(files.src, count_lines(files.src), files.tgt, count_lines(files.tgt))
    main = prepare_run_corpus(options, tokenizers)
    settings = prepare_settings(options, main.tokenizers)
    corpora = [main]
    for number, files in enumerate(extras):
        path = (Path(f"{options.prepared_dir}.extra{number}") if options.prepared_dir
                else default_prepared_dir({"train": files}, settings))
        corpora.append(ensure_prepared({"train": files}, settings, path, progress=not options.quiet))
    return corpora


def open_run_corpora(options: TrainOptions, rank: int, world_size: int,
                     tokenizers: Tokenizers | None = None) -> list[PreparedCorpus]:
    """Rank 0 prepares or opens the corpora (prepare_run_corpora); every other rank waits for it and opens the
    directories it names."""
    if world_size == 1:
        return prepare_run_corpora(options, tokenizers)
    group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    message: list[object] = [None]
    if rank == 0:
        try:
            corpora = prepare_run_corpora(options, tokenizers)
        except Exception:
            # Rank 0 prints the error; the others end without printing it again. A Ctrl-C (torchrun forwards it to
            # every rank) is not broadcast: the others are ending on it too.
            with contextlib.suppress(RuntimeError):  # the other ranks are gone
                dist.broadcast_object_list([("error",)], src=0, group=group)
            raise
        message = [[(str(corpus.path), corpus.digest) for corpus in corpora]]
    dist.broadcast_object_list(message, src=0, group=group)
    dist.destroy_process_group(group)
    if rank == 0:
        return corpora
    if message[0][0] == "error":
        raise SystemExit(1)  # rank 0 printed why
    return [_open_prepared(Path(path), digest, rank) for path, digest in message[0]]


def _open_prepared(path: Path, digest: str, rank: int) -> PreparedCorpus:
    try:
        corpus = PreparedCorpus(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"rank {rank} cannot open the corpus rank 0 prepared ({error}); on several nodes, put "
                         f"--prepared-dir on storage that every node mounts") from None
    if corpus.digest != digest:
        raise ValueError(f"rank {rank} found another preparation at {path} than rank 0 made: was it replaced?")
    return corpus
