"""Text in, text out: a model with its tokenizers, read from a fastformer checkpoint or a Marian (OPUS-MT) directory.

    translator = fastformer.load_translator("opus-mt-en-de")   # or "runs/demo/checkpoint_00004000.pt"
    translator.translate(["The house is small."], beam_size=4)
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from fastformer import checkpoint, marian
from fastformer.config import TransformerConfig
from fastformer.data import Tokenizer
from fastformer.model import Transformer


class TextTokenizer(Protocol):
    """Text <-> ids without BOS/EOS: fastformer's shared Tokenizer, or one side of a Marian model."""

    def encode(self, sentences: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[list[int]]) -> list[str]: ...


class Translator:
    """A Transformer with the tokenizers of its source and target sides."""

    def __init__(self, model: Transformer, source_tokenizer: TextTokenizer, target_tokenizer: TextTokenizer) -> None:
        self.model = model
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer

    def translate(self, sentences: list[str], beam_size: int = 4, length_penalty: float = 0.6,
                  batch_tokens: int = 4096, max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 1,
                  length_penalty_form: str = "gnmt") -> list[str]:
        """Translates sentences in length-sorted batches of about batch_tokens source tokens (padding included);
        the output keeps the input order. The search options are those of `Transformer.translate`."""
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        config = self.model.config
        # Sources longer than the model's positions are cut; EOS ends every source as in training.
        limit = config.max_positions - 1
        sources = [ids[:limit] + [config.eos_id] for ids in self.source_tokenizer.encode(sentences)]
        translations: list[str] = [""] * len(sources)
        for indices in _token_budget_batches([len(ids) for ids in sources], batch_tokens):
            src = torch.nn.utils.rnn.pad_sequence([torch.tensor(sources[i]) for i in indices], batch_first=True,
                                                  padding_value=config.pad_id).to(self.model.output_weight.device)
            hypotheses = self.model.translate(src, beam_size=beam_size, length_penalty=length_penalty,
                                              max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len,
                                              length_penalty_form=length_penalty_form)
            for i, text in zip(indices, self.target_tokenizer.decode([best[0].tokens for best in hypotheses])):
                translations[i] = text
        return translations


def _token_budget_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """-> indices grouped by length so that each batch's size * longest length stays within batch_tokens (a
    longer single sentence is a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        # Sorted ascending, so the newcomer is the batch's longest.
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def load_translator(path: str | Path, device: str | torch.device | None = None) -> Translator:
    """A fastformer checkpoint file or a Marian directory (transformers layout) -> its Translator, the model in
    eval mode on `device` (default: CUDA when available, else the CPU)."""
    path = Path(path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if path.is_dir():
        model, source_tokenizer, target_tokenizer = marian.load_marian(path)
    else:
        model, tokenizer = load_checkpoint_model(path)
        source_tokenizer = target_tokenizer = tokenizer
    return Translator(model.to(device), source_tokenizer, target_tokenizer)


def load_checkpoint_model(path: Path) -> tuple[Transformer, Tokenizer]:
    """A fastformer checkpoint (trained or averaged) -> (the model in eval mode on the CPU, its tokenizer)."""
    state = checkpoint.load_checkpoint(path)
    if "tokenizer" not in state:
        raise ValueError(f"{path} holds no tokenizer: it was not written by `fastformer train`")
    try:
        model = Transformer(TransformerConfig(**state["config"]))
        model.load_state_dict(state["model"])
        tokenizer = Tokenizer(state["tokenizer"].numpy().tobytes())
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path} does not hold a usable model: {error}") from None
    return model.eval(), tokenizer
