"""Inference from checkpoints: batched beam-search translation, corpus loss, and sacreBLEU as WMT reports it."""

from __future__ import annotations

from pathlib import Path

import sacrebleu
import torch

from fastformer import checkpoint
from fastformer.config import TransformerConfig
from fastformer.data import EOS_ID, PAD_ID, TokenBatchSampler, TokenizedCorpus, Tokenizer
from fastformer.model import Transformer


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer]:
    """A checkpoint (trained or averaged) -> (model in eval mode on device, its tokenizer)."""
    state = checkpoint.load_checkpoint(path)
    if "tokenizer" not in state:
        raise ValueError(f"{path} holds no tokenizer: it was not written by `fastformer train`")
    try:
        model = Transformer(TransformerConfig(**state["config"]))
        model.load_state_dict(state["model"])
        tokenizer = Tokenizer(state["tokenizer"].numpy().tobytes())
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path} does not hold a usable model: {error}") from None
    return model.to(device).eval(), tokenizer


def translate_sentences(model: Transformer, tokenizer: Tokenizer, sentences: list[str], beam_size: int = 4,
                        length_penalty: float = 0.6, batch_tokens: int = 4096,
                        length_penalty_form: str = "gnmt") -> list[str]:
    """Translates sentences in length-sorted batches of about batch_tokens source tokens; output keeps input order."""
    device = model.output_weight.device
    limit = model.config.max_positions - 1
    # Sources longer than the model's positions are cut; EOS ends every source as in training.
    sources = [ids[:limit] + [EOS_ID] for ids in tokenizer.encode(sentences)]
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    translations: list[str] = [""] * len(sources)
    start = 0
    while start < len(order):
        longest = len(sources[order[start]])
        end = start + 1
        while end < len(order) and (end - start + 1) * max(longest, len(sources[order[end]])) <= batch_tokens:
            longest = max(longest, len(sources[order[end]]))
            end += 1
        indices = order[start:end]
        src = torch.nn.utils.rnn.pad_sequence([torch.tensor(sources[i]) for i in indices], batch_first=True,
                                              padding_value=PAD_ID).to(device)
        hypotheses = model.translate(src, beam_size=beam_size, length_penalty=length_penalty,
                                     length_penalty_form=length_penalty_form)
        for i, text in zip(indices, tokenizer.decode([best[0].tokens for best in hypotheses])):
            translations[i] = text
        start = end
    return translations


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
