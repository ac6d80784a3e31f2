"""Text in, text out: a model with its tokenizers, read from a fastformer checkpoint or a Marian (OPUS-MT) directory.

    translator = fastformer.load_translator("opus-mt-en-de")   # or "runs/demo/checkpoint_00004000.pt"
    translator.translate(["The house is small."], beam_size=4)
    translator.score(["The house is small."], ["Das Haus ist klein."])   # [ScoreResult(total, normalized, ...)]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from fastformer import checkpoint
from fastformer.config import TransformerConfig
from fastformer.data import Tokenizer, token_budget_batches
from fastformer.data.tokenizer import TextTokenizer, Tokenizers
from fastformer.decoding import compiled
from fastformer.decoding.rules import PrefixTooLongError
from fastformer.decoding.scoring import right_padded
from fastformer.decoding.shortlist import Shortlist
from fastformer.model import Transformer
from fastformer.translation import marian

# (index of the sentence, its source tokens, the model's limit) -> reports that only the first `limit` are translated.
OnTruncated = Callable[[int, int, int], None]


class TranslationResult(NamedTuple):
    """One hypothesis of a sentence."""

    text: str
    score: float | None  # as Hypothesis.score; None unless asked for
    tokens: list[str]  # the target pieces, without EOS
    attention: torch.Tensor | None  # [len(tokens) + 1, source tokens with EOS]; None unless asked for


# The result of a blank sentence, which is not translated.
BLANK = TranslationResult("", None, [], None)


class ScoreResult(NamedTuple):
    """A target scored given its source: the sum of its log-probabilities, that sum over its scored tokens (EOS
    included), the target's pieces with EOS last, and each one's log-probability."""
    total: float
    normalized: float
    tokens: list[str]
    token_scores: list[float]


class Translator:
    """A Transformer with the tokenizers of its source and target sides, translating in one compute type.

    compute_type: as `Transformer.translate` takes it (None: the model's dtype); resolved here ("auto" becomes the
    type it picks, a bad value is a ValueError) and the model's weights converted to it now, not on the first call."""

    def __init__(self, model: Transformer, source_tokenizer: TextTokenizer, target_tokenizer: TextTokenizer,
                 compute_type: str | None = None) -> None:
        self.model = model
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer
        weight = model.output_weight
        self.compute_type = compiled.resolve_compute_type(compute_type, weight.device, weight.dtype)
        compiled.compiled_model(model, self.compute_type)

    @property
    def converted_nbytes(self) -> int:
        """The bytes of the model's linear layers as converted to the compute type (converted again if the model
        changed since)."""
        return compiled.compiled_model(self.model, self.compute_type).nbytes

    def translate(self, sentences: list[str], beam_size: int = 4, length_penalty: float = 0.6,
                  batch_tokens: int = 4096, max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 1,
                  length_penalty_form: str = "gnmt", on_truncated: OnTruncated | None = None, n_best: int = 1,
                  return_scores: bool = False, sampling_topk: int = 1, sampling_topp: float = 1.0,
                  sampling_temperature: float = 1.0, seed: int = 0, target_prefix: list[str | None] | None = None,
                  no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0, return_attention: bool = False,
                  shortlist: Shortlist | None = None) -> list[str] | list[list[TranslationResult]]:
        """Translates sentences -> per sentence its best translation; with n_best > 1, return_scores or
        return_attention, per sentence its n_best TranslationResults, best first. As `hypotheses` does."""
        results = self.hypotheses(sentences, batch_tokens=batch_tokens, on_truncated=on_truncated,
                                  target_prefix=target_prefix, beam_size=beam_size, length_penalty=length_penalty,
                                  max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len,
                                  length_penalty_form=length_penalty_form, n_best=n_best, return_scores=return_scores,
                                  sampling_topk=sampling_topk, sampling_topp=sampling_topp,
                                  sampling_temperature=sampling_temperature, seed=seed,
                                  no_repeat_ngram_size=no_repeat_ngram_size, repetition_penalty=repetition_penalty,
                                  return_attention=return_attention, shortlist=shortlist)
        if n_best > 1 or return_scores or return_attention:
            return results
        return [best[0].text for best in results]

    def hypotheses(self, sentences: list[str], batch_tokens: int = 4096, on_truncated: OnTruncated | None = None,
                   target_prefix: list[str | None] | None = None, return_scores: bool = False,
                   return_attention: bool = False, first_line: int = 1,
                   **search: object) -> list[list[TranslationResult]]:
        """Translates sentences in length-sorted batches of about batch_tokens source tokens (padding included)
        -> per sentence its hypotheses, best first, in the input order. `search`: the options of
        `Transformer.translate` (beam_size, n_best, sampling_topk, ...).

        target_prefix: per sentence a text (encoded by the target tokenizer, without EOS) that each hypothesis
        starts with, or None. A blank sentence (or one of no tokens) is not translated: its result is [BLANK] (so
        that output stays line-aligned with input), whatever its prefix. A sentence longer than the model's positions
        is cut to them, and on_truncated is told (by default a warning: never a silent cut). Scores are None unless
        return_scores, attention None unless return_attention. A prefix too long for its sentence, or a text that is
        not valid Unicode, is a ValueError naming its line (sentences[0] being line first_line)."""
        _check_list("sentences", sentences)
        if target_prefix is not None and len(target_prefix) != len(sentences):
            raise ValueError(f"target_prefix has {len(target_prefix)} entries for {len(sentences)} sentences: give "
                             f"one (a text or None) per sentence")
        kept = [i for i, sentence in enumerate(sentences) if sentence.strip()]
        prefixes = self._prefix_ids(target_prefix, kept)
        results = [[BLANK] for _ in sentences]
        for indices, src in self._source_batches(sentences, kept, batch_tokens, on_truncated or _warn_long_sentence,
                                                 first_line):
            try:
                found = self.model.translate(src, compute_type=self.compute_type, return_scores=return_scores,
                                             return_attention=return_attention,
                                             target_prefix=[prefixes.get(i) for i in indices] if prefixes else None,
                                             **search)
            except PrefixTooLongError as error:
                raise ValueError(f"line {first_line + indices[error.sentence]}: the target prefix "
                                 f"{error.problem}") from None
            for i, sentence in zip(indices, found):
                texts = self.target_tokenizer.decode([hypothesis.tokens for hypothesis in sentence])
                results[i] = [TranslationResult(text, hypothesis.score, self.target_tokenizer.pieces(hypothesis.tokens),
                                                hypothesis.attention) for hypothesis, text in zip(sentence, texts)]
        return results

    def _prefix_ids(self, target_prefix: list[str | None] | None, kept: list[int]) -> dict[int, list[int]]:
        """-> {index of a kept sentence: its prefix's target ids} for the sentences given a non-empty prefix."""
        if target_prefix is None:
            return {}
        given = [i for i in kept if target_prefix[i]]
        encoded = self.target_tokenizer.encode([target_prefix[i] for i in given])
        return {i: ids for i, ids in zip(given, encoded) if ids}

    def score(self, sources: list[str], targets: list[str], batch_tokens: int = 4096,
              first_line: int = 1) -> list[ScoreResult]:
        """Each target's log-probabilities given its source (`Transformer.score`, teacher forcing), in length-sorted
        batches of about batch_tokens source tokens as `translate` makes them; the output keeps the input order.

        Unequal numbers of sources and targets, a blank source or target (or one of no tokens), or one over the
        model's positions is a ValueError naming the line (sources[0] being line first_line), raised before any
        scoring."""
        _check_list("sources", sources)
        _check_list("targets", targets)
        if len(sources) != len(targets):
            raise ValueError(f"score got {len(sources)} sources and {len(targets)} targets: it needs one target per "
                             "source")
        for i, (source, target) in enumerate(zip(sources, targets)):
            for side, text in (("source", source), ("target", target)):
                if not text.strip():
                    raise ValueError(f"line {first_line + i}: the {side} is blank: scoring needs a source and a "
                                     "target")
        config = self.model.config
        limit = config.max_positions - 1  # and BOS
        target_ids, long_counts = _encode(self.target_tokenizer, targets, first_line, "target", keep=limit)
        for i, ids in enumerate(target_ids):
            if not 1 <= len(ids) <= limit:
                raise ValueError(f"line {first_line + i}: the target has {long_counts.get(i, len(ids))} tokens, the "
                                 f"model scores 1 to {limit}")
        batches = self._source_batches(sources, list(range(len(sources))), batch_tokens,
                                       lambda i, n_tokens, limit: _reject_long_source(first_line + i, n_tokens, limit),
                                       first_line, on_empty=lambda i: _reject_empty_source(first_line + i))
        results: list[ScoreResult] = [None] * len(sources)  # type: ignore[list-item]
        for indices, src in batches:
            scores = self.model.score(src, [target_ids[i] for i in indices], compute_type=self.compute_type)
            for i, token_scores in zip(indices, scores):
                values = token_scores.tolist()
                total = sum(values)
                results[i] = ScoreResult(total, total / len(values),
                                         self.target_tokenizer.pieces(target_ids[i] + [config.eos_id]), values)
        return results

    def _source_batches(self, sentences: list[str], indices: list[int], batch_tokens: int, report: OnTruncated,
                        first_line: int, on_empty: Callable[[int], None] | None = None
                        ) -> Iterator[tuple[list[int], torch.Tensor]]:
        """The sentences at `indices`, encoded now (one longer than the model's positions cut to them and `report`
        told; EOS appended, as in training; one of no tokens, such as a zero-width space, left out, or on_empty told)
        -> per length-sorted batch of about batch_tokens source tokens (padding included): (its sentences' indices,
        src [batch, src_len] on the model's device), padded as it is reached."""
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        config = self.model.config
        limit = config.max_positions - 1  # and EOS
        sources: dict[int, list[int]] = {}
        encoded, long_counts = _encode(self.source_tokenizer, [sentences[i] for i in indices], first_line, "source",
                                       indices, keep=limit)
        for k, (i, ids) in enumerate(zip(indices, encoded)):
            if not ids:
                if on_empty is not None:
                    on_empty(i)
                continue
            if len(ids) > limit:
                report(i, long_counts.get(k, len(ids)), limit)
            sources[i] = ids[:limit] + [config.eos_id]
        indices = list(sources)
        sizes = [len(sources.get(i, ())) for i in range(len(sentences))]
        device = self.model.output_weight.device
        return ((batch.tolist(), right_padded([sources[i] for i in batch], config.pad_id, device))
                for batch in token_budget_batches(sorted(indices, key=sizes.__getitem__), sizes, batch_tokens))


def _warn_long_sentence(index: int, n_tokens: int, limit: int) -> None:
    warnings.warn(f"sentence {index + 1} has {n_tokens} source tokens, more than the model's limit of {limit}: only "
                  f"its first {limit} were translated", stacklevel=4)


def _check_list(name: str, texts: list[str]) -> None:
    if isinstance(texts, str):
        raise TypeError(f"{name} must be a list of texts, one per sentence, not a str: wrap it in a list")


# A text longer than this many characters is tokenized a piece at a time: sentencepiece holds ~48 bytes a character
# of what it encodes at once (a 50 MB line took 2.45 GB), and the model reads only its first max_positions tokens.
LONG_TEXT_CHARS = 1 << 16


def _encode(tokenizer: TextTokenizer, texts: list[str], first_line: int, side: str, indices: list[int] | None = None,
            keep: int = 0) -> tuple[list[list[int]], dict[int, int]]:
    """-> (tokenizer.encode(texts), {k: the number of ids of texts[k]} for the texts over LONG_TEXT_CHARS characters,
    of which only the first keep + 1 ids are returned). A text that is not a str, or not valid Unicode (a lone
    surrogate), is a ValueError naming its line (texts[k] being line first_line + indices[k], or + k)."""
    try:
        long = {k: text for k, text in enumerate(texts) if isinstance(text, str) and len(text) > LONG_TEXT_CHARS}
        encoded = tokenizer.encode([text if k not in long else "" for k, text in enumerate(texts)])
        counts = {}
        for k, text in long.items():
            encoded[k], counts[k] = _encode_in_pieces(tokenizer, text, keep + 1)
        return encoded, counts
    except (TypeError, UnicodeError):
        for k, text in enumerate(texts):
            line = first_line + (k if indices is None else indices[k])
            if not isinstance(text, str):
                raise ValueError(f"line {line}: the {side} is a {type(text).__name__}, not a str") from None
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(f"line {line}: the {side} is not valid Unicode text ({error.reason} at character "
                                 f"{error.start})") from None
        raise


def _encode_in_pieces(tokenizer: TextTokenizer, text: str, keep: int) -> tuple[list[int], int]:
    """A long text's first `keep` ids and its number of ids, encoded LONG_TEXT_CHARS characters at a time, each piece
    cut at a space where it has one (sentencepiece's pieces do not cross whitespace: the ids are the whole text's;
    a piece cut within a word may start one more piece there, which only the count can see)."""
    kept: list[int] = []
    count = start = 0
    while start < len(text):
        end = len(text) if len(text) - start <= LONG_TEXT_CHARS else start + LONG_TEXT_CHARS
        if end < len(text):
            space = text.rfind(" ", start + 1, end)
            end = space if space > start else end
        ids = tokenizer.encode([text[start:end]])[0]
        kept += ids[:keep - len(kept)]
        count += len(ids)
        start = end
    return kept, count


def _reject_empty_source(line: int) -> None:
    raise ValueError(f"line {line}: the source has no tokens (only characters the tokenizer drops): scoring needs a "
                     "source and a target")


def _reject_long_source(line: int, n_tokens: int, limit: int) -> None:
    raise ValueError(f"line {line}: the source has {n_tokens} tokens, more than the model's limit of {limit}: a "
                     "score of a cut source would not be the pair's")


def load_translator(path: str | Path, device: str | torch.device | None = None,
                    compute_type: str | None = None) -> Translator:
    """A fastformer checkpoint file or a Marian directory (transformers layout) -> its Translator, the model in
    eval mode on `device` (default: CUDA when available, else the CPU), its weights converted to `compute_type`."""
    path = Path(path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if path.is_dir():
        if (path / "model.bin").is_file():
            raise ValueError(f"{path} is a CTranslate2 model directory (what `fastformer export` writes): translate "
                             "with CTranslate2, or give the fastformer checkpoint it was exported from")
        if checkpoint.list_checkpoints(path):
            raise ValueError(f"{path} is a training run's directory: give one of its checkpoint_*.pt files, or "
                             f"--out-dir {path} for its newest")
        model, source_tokenizer, target_tokenizer = marian.load_marian(path)
    else:
        model, tokenizers = load_checkpoint_tokenizers(path)
        source_tokenizer, target_tokenizer = tokenizers.source, tokenizers.target
    return Translator(model.to(device), source_tokenizer, target_tokenizer, compute_type)


def load_checkpoint_tokenizers(path: Path) -> tuple[Transformer, Tokenizers]:
    """A fastformer checkpoint (trained or averaged) -> (the model in eval mode on the CPU, its tokenizers: the shared
    one it trained, or those of the Marian model it was fine-tuned from)."""
    saved = checkpoint.load_checkpoint(path)
    if saved.tokenizer is None:
        raise ValueError(f"{path} holds no tokenizer: it was not written by `fastformer train`")
    try:
        model = Transformer(TransformerConfig(**saved.config))
        model.load_state_dict(saved.model)
        # A run with --tag-extra learned its vocabulary with the tag reserved.
        reserved = tuple(tag for tag in [(saved.options or {}).get("tag_extra")] if tag)
        tokenizers = Tokenizers.from_checkpoint_entry(saved.tokenizer, str(path), reserved)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path} does not hold a usable model: {checkpoint.state_dict_error_line(error)}") from None
    model_ids = {name: getattr(model.config, name) for name in tokenizers.special_ids}
    if model_ids != tokenizers.special_ids:
        raise ValueError(f"{path}: its model's special ids {model_ids} are not its tokenizer's "
                         f"{tokenizers.special_ids}")
    return model.eval(), tokenizers


def load_checkpoint_model(path: Path) -> tuple[Transformer, Tokenizer]:
    """A fastformer checkpoint with one shared tokenizer -> (the model in eval mode on the CPU, its tokenizer); one
    fine-tuned from a Marian model, whose sides have their own, is an error saying so."""
    model, tokenizers = load_checkpoint_tokenizers(path)
    if not isinstance(tokenizers.source, Tokenizer):
        raise ValueError(f"{path} holds a Marian model's separate source and target tokenizers: translate it with "
                         f"load_translator or load_checkpoint_tokenizers")
    return model, tokenizers.source
