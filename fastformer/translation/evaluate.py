"""Inference from checkpoints: batched beam-search translation, corpus loss, and sacreBLEU as WMT reports it."""

from __future__ import annotations

from collections.abc import Callable

import sacrebleu
import torch

from fastformer.data import TokenBatchSampler, TokenizedCorpus, Tokenizer
from fastformer.model import Transformer
from fastformer.translation.translator import OnTruncated, Translator


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


def translate_sentences(model: Transformer, tokenizer: Tokenizer, sentences: list[str], beam_size: int = 4,
                        length_penalty: float = 0.6, batch_tokens: int = 4096, length_penalty_form: str = "gnmt",
                        on_truncated: OnTruncated | None = None) -> list[str]:
    """`Translator.translate` for a model whose source and target share one tokenizer."""
    return Translator(model, tokenizer, tokenizer).translate(
        sentences, beam_size=beam_size, length_penalty=length_penalty, batch_tokens=batch_tokens,
        length_penalty_form=length_penalty_form, on_truncated=on_truncated)


@torch.no_grad()
def corpus_nll(model: Transformer, corpus: TokenizedCorpus, batch_tokens: int, device: torch.device,
               stop: Callable[[], bool] = lambda: False) -> float | None:
    """Mean negative log-likelihood per target token (no label smoothing) of a tokenized corpus; None where stop()
    turned true before a batch."""
    sampler = TokenBatchSampler(corpus.src_lengths, corpus.tgt_lengths, max(batch_tokens, 1024))
    total_loss = total_tokens = 0.0
    for indices in sampler.batches(0):
        if stop():
            return None
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
