"""Text in, text out: a model with its tokenizers, read from a fastformer checkpoint or a Marian (OPUS-MT) directory.

    translator = fastformer.load_translator("opus-mt-en-de")   # or "runs/demo/checkpoint_00004000.pt"
    translator.translate(["The house is small."], beam_size=4)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from fastformer import checkpoint
from fastformer.config import TransformerConfig
from fastformer.data import Tokenizer, token_budget_batches
from fastformer.data.tokenizer import TextTokenizer, Tokenizers
from fastformer.decoding import compiled
from fastformer.model import Transformer
from fastformer.translation import marian

# (index of the sentence, its source tokens, the model's limit) -> reports that only the first `limit` are translated.
OnTruncated = Callable[[int, int, int], None]
# The options of Transformer.translate beyond the beam search, at the values that leave it the plain search.
PLAIN_SEARCH = dict(sampling_topk=1, sampling_topp=1.0, sampling_temperature=1.0, seed=0, no_repeat_ngram_size=0,
                    repetition_penalty=1.0)


class TranslationResult(NamedTuple):
    """One hypothesis of a sentence."""

    text: str
    score: float | None  # as Hypothesis.score; None unless asked for
    tokens: list[str]  # the target pieces, without EOS
    attention: torch.Tensor | None  # [len(tokens) + 1, source tokens with EOS]; None unless asked for


# The result of a blank sentence, which is not translated.
BLANK = TranslationResult("", None, [], None)


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
                  no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0,
                  return_attention: bool = False) -> list[str] | list[list[TranslationResult]]:
        """Translates sentences -> per sentence its best translation; with n_best > 1, return_scores or
        return_attention, per sentence its n_best TranslationResults, best first. As `hypotheses` does."""
        results = self.hypotheses(sentences, batch_tokens=batch_tokens, on_truncated=on_truncated,
                                  target_prefix=target_prefix, beam_size=beam_size, length_penalty=length_penalty,
                                  max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len,
                                  length_penalty_form=length_penalty_form, n_best=n_best, return_scores=return_scores,
                                  sampling_topk=sampling_topk, sampling_topp=sampling_topp,
                                  sampling_temperature=sampling_temperature, seed=seed,
                                  no_repeat_ngram_size=no_repeat_ngram_size, repetition_penalty=repetition_penalty,
                                  return_attention=return_attention)
        if n_best > 1 or return_scores or return_attention:
            return results
        return [best[0].text for best in results]

    def hypotheses(self, sentences: list[str], batch_tokens: int = 4096, on_truncated: OnTruncated | None = None,
                   target_prefix: list[str | None] | None = None, return_scores: bool = False,
                   return_attention: bool = False, **search: object) -> list[list[TranslationResult]]:
        """Translates sentences in length-sorted batches of about batch_tokens source tokens (padding included)
        -> per sentence its hypotheses, best first, in the input order. `search`: the options of
        `Transformer.translate` (beam_size, n_best, sampling_topk, ...).

        target_prefix: per sentence a text (encoded by the target tokenizer, without EOS) that each hypothesis
        starts with, or None. A blank sentence is not translated: its result is [BLANK] (so that output stays
        line-aligned with input), whatever its prefix. A sentence longer than the model's positions is cut to them,
        and on_truncated is told (by default a warning: never a silent cut). Scores are None unless return_scores,
        attention None unless return_attention."""
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        if target_prefix is not None and len(target_prefix) != len(sentences):
            raise ValueError(f"target_prefix has {len(target_prefix)} entries for {len(sentences)} sentences: give "
                             f"one (a text or None) per sentence")
        config = self.model.config
        limit = config.max_positions - 1  # and EOS
        report = on_truncated if on_truncated is not None else _warn_long_sentence
        kept = [i for i, sentence in enumerate(sentences) if sentence.strip()]
        sources: dict[int, list[int]] = {}
        for i, ids in zip(kept, self.source_tokenizer.encode([sentences[i] for i in kept])):
            if len(ids) > limit:
                report(i, len(ids), limit)
            sources[i] = ids[:limit] + [config.eos_id]  # EOS ends every source, as in training
        prefixes = self._prefix_ids(target_prefix, kept)
        # Options that issue 32's search adds go through only when set: at their defaults the search is the plain one.
        options = {name: value for name, value in search.items()
                   if name not in PLAIN_SEARCH or value != PLAIN_SEARCH[name]}
        if return_attention:
            options["return_attention"] = True
        sizes = [len(sources.get(i, ())) for i in range(len(sentences))]
        results = [[BLANK] for _ in sentences]
        for indices in token_budget_batches(sorted(kept, key=sizes.__getitem__), sizes, batch_tokens):
            src = torch.nn.utils.rnn.pad_sequence([torch.tensor(sources[i]) for i in indices], batch_first=True,
                                                  padding_value=config.pad_id).to(self.model.output_weight.device)
            if prefixes:
                options["target_prefix"] = [prefixes.get(i) for i in indices]
            found = self.model.translate(src, compute_type=self.compute_type, return_scores=return_scores, **options)
            for i, sentence in zip(indices, found):
                ids = [hypothesis.tokens for hypothesis in sentence]
                texts, pieces = self.target_tokenizer.decode(ids), self.target_tokenizer.to_pieces(ids)
                results[i] = [TranslationResult(text, hypothesis.score, tokens,
                                                hypothesis.attention if return_attention else None)
                              for hypothesis, text, tokens in zip(sentence, texts, pieces)]
        return results

    def _prefix_ids(self, target_prefix: list[str | None] | None, kept: list[int]) -> dict[int, list[int]]:
        """-> {index of a kept sentence: its prefix's target ids} for the sentences given a non-empty prefix."""
        if target_prefix is None:
            return {}
        given = [i for i in kept if target_prefix[i]]
        encoded = self.target_tokenizer.encode([target_prefix[i] for i in given])
        return {i: ids for i, ids in zip(given, encoded) if ids}


def _warn_long_sentence(index: int, n_tokens: int, limit: int) -> None:
    warnings.warn(f"sentence {index + 1} has {n_tokens} source tokens, more than the model's limit of {limit}: only "
                  f"its first {limit} were translated", stacklevel=3)


def load_translator(path: str | Path, device: str | torch.device | None = None,
                    compute_type: str | None = None) -> Translator:
    """A fastformer checkpoint file or a Marian directory (transformers layout) -> its Translator, the model in
    eval mode on `device` (default: CUDA when available, else the CPU), its weights converted to `compute_type`."""
    path = Path(path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if path.is_dir():
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
        raise ValueError(f"{path} does not hold a usable model: {error}") from None
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
                         f"load_translator, export the Marian model with CTranslate2's own converter")
    return model, tokenizers.source
