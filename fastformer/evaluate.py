"""Inference from checkpoints: batched beam-search translation, corpus loss, and sacreBLEU as WMT reports it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import sacrebleu
import torch

from fastformer import checkpoint
from fastformer.config import TransformerConfig
from fastformer.data import TokenBatchSampler, TokenizedCorpus, Tokenizer, token_budget_batches
from fastformer.model import Transformer

# (index of the sentence, its source tokens, the model's limit) -> reports that only the first `limit` are translated.
OnTruncated = Callable[[int, int, int], None]


def resolve_device(option: str, local_rank: int = 0) -> torch.device:
    """--device -> the device: "auto" is cuda:local_rank when a GPU is visible, else the CPU. A device this torch or
    machine lacks is an error here, before any work."""
    if option == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(option)
    except RuntimeError:
        raise ValueError(f"--device {option!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {option!r}: fastformer runs on cpu or cuda")
    if not torch.cuda.is_available():
        reason = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"--device {option}: {reason}; use --device cpu (or auto)")
    if device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) are visible")
    return device


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer]:
    """A checkpoint (trained or averaged) -> (model in eval mode on device, its tokenizer)."""
    saved = checkpoint.load_checkpoint(path)
    if saved.tokenizer is None:
        raise ValueError(f"{path} holds no tokenizer: it was not written by `fastformer train`")
    try:
        model = Transformer(TransformerConfig(**saved.config))
        model.load_state_dict(saved.model)
        tokenizer = Tokenizer(saved.tokenizer)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path} does not hold a usable model: {error}") from None
    model_ids = {name: getattr(model.config, name) for name in tokenizer.special_ids}
    if model_ids != tokenizer.special_ids:
        raise ValueError(f"{path}: its model's special ids {model_ids} are not its tokenizer's {tokenizer.special_ids}")
    return model.to(device).eval(), tokenizer


def _cut_to_limit(ids: list[int], index: int, limit: int, on_truncated: OnTruncated) -> list[int]:
    if len(ids) > limit:
        on_truncated(index, len(ids), limit)
    return ids[:limit]


def translate_sentences(model: Transformer, tokenizer: Tokenizer, sentences: list[str], beam_size: int = 4,
                        length_penalty: float = 0.6, batch_tokens: int = 4096,
                        on_truncated: OnTruncated | None = None) -> list[str]:
    """Translates sentences in length-sorted batches of about batch_tokens source tokens; output keeps input order.

    A blank sentence translates to "" (so that output stays line-aligned with input). A sentence longer than the
    model's positions is cut to them, and on_truncated is told (by default a warning: never a silent cut)."""
    device = model.output_weight.device
    config = model.config
    limit = config.max_positions - 1  # and EOS
    if on_truncated is None:
        on_truncated = _warn_long_sentence
    translations: list[str] = [""] * len(sentences)
    kept = [i for i, sentence in enumerate(sentences) if sentence.strip()]
    # EOS ends every source, as in training.
    sources = {i: _cut_to_limit(ids, i, limit, on_truncated) + [config.eos_id]
               for i, ids in zip(kept, tokenizer.encode([sentences[i] for i in kept]))}
    order = sorted(kept, key=lambda i: len(sources[i]))
    sizes = [len(sources[i]) if i in sources else 0 for i in range(len(sentences))]
    for indices in token_budget_batches(order, sizes, batch_tokens):
        src = torch.nn.utils.rnn.pad_sequence([torch.tensor(sources[i]) for i in indices], batch_first=True,
                                              padding_value=config.pad_id).to(device)
        hypotheses = model.translate(src, beam_size=beam_size, length_penalty=length_penalty)
        for i, text in zip(indices, tokenizer.decode([best[0].tokens for best in hypotheses])):
            translations[i] = text
    return translations


def _warn_long_sentence(index: int, n_tokens: int, limit: int) -> None:
    warnings.warn(f"sentence {index + 1} has {n_tokens} source tokens, more than the model's limit of {limit}: only "
                  f"its first {limit} were translated", stacklevel=4)


@torch.no_grad()
def corpus_nll(model: Transformer, corpus: TokenizedCorpus, batch_tokens: int, device: torch.device) -> float:
    """Mean negative log-likelihood per target token (no label smoothing) of a tokenized corpus."""
    sampler = TokenBatchSampler(corpus.src_lengths, corpus.tgt_lengths, max(batch_tokens, 1024))
    total_loss = total_tokens = 0.0
    for indices in sampler.batches(0):
        src, tgt_in, tgt_out = (tensor.to(device) for tensor in corpus.collate(indices))
        total_loss += model.loss(src, tgt_in, tgt_out, reduction="sum").item()
        total_tokens += int((tgt_out != model.config.pad_id).sum())
    return total_loss / max(total_tokens, 1.0)


def bleu(hypotheses: list[str], references: list[str]) -> list[tuple[float, str]]:
    """-> [(score, report line with sacreBLEU's signature)] for cased BLEU with the 13a tokenizer (as WMT reports)
    and with the intl tokenizer."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    results = []
    for tokenize in ("13a", "intl"):
        metric = sacrebleu.metrics.BLEU(tokenize=tokenize)
        score = metric.corpus_score(hypotheses, [references])
        # sacreBLEU's own text format: "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:... = 27.3 ...".
        results.append((score.score, score.format(signature=str(metric.get_signature()))))
    return results
