"""The shared English-German sentencepiece BPE vocabulary, with the special ids the model's config expects."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
TRAINING_SEED = 1


class Tokenizer:
    """A sentencepiece model: text <-> ids; ids never include BOS/EOS (callers add them)."""

    def __init__(self, model_proto: bytes) -> None:
        self.model_proto = bytes(model_proto)
        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(self.model_proto)
        except Exception as error:  # sentencepiece raises bare RuntimeError/OSError for a bad proto
            raise ValueError(f"not a sentencepiece model: {error}") from None
        expected = {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "unk": UNK_ID}
        actual = {"pad": self.processor.pad_id(), "bos": self.processor.bos_id(), "eos": self.processor.eos_id(),
                  "unk": self.processor.unk_id()}
        if actual != expected:
            raise ValueError(f"sentencepiece model has special ids {actual}, fastformer needs {expected}")

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"sentencepiece model not found: {path}")
        try:
            return cls(path.read_bytes())
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    def save(self, path: Path) -> None:
        Path(path).write_bytes(self.model_proto)

    @property
    def special_ids(self) -> dict[str, int]:
        """{"pad_id", "bos_id", "eos_id"}: this vocabulary's ids, named as TransformerConfig's fields, so that a model
        is built with (and checked against) the ids of the tokenizer it is trained with."""
        return {"pad_id": self.processor.pad_id(), "bos_id": self.processor.bos_id(),
                "eos_id": self.processor.eos_id()}

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    def encode(self, sentences: list[str]) -> list[list[int]]:
        return self.processor.encode(sentences, out_type=int)

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.processor.decode(ids)


def train_tokenizer(sentences: Iterable[str], vocab_size: int = 37000, seed_sentences: int = 2_000_000) -> Tokenizer:
    """BPE over the sentences of both languages (the paper: one shared ~37k vocabulary for En-De).

    vocab_size is an upper bound: a small corpus that cannot fill it gets a smaller vocabulary instead of an error.
    """
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be at least 8, got {vocab_size}")
    model = io.BytesIO()
    # A corpus larger than seed_sentences is sampled: seeded, so that the same corpus always gives the same model.
    spm.set_random_generator_seed(TRAINING_SEED)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        hard_vocab_limit=False, character_coverage=1.0, input_sentence_size=seed_sentences,
        shuffle_input_sentence=True, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
        num_threads=min(16, os.cpu_count() or 1), minloglevel=2,
    )
    return Tokenizer(model.getvalue())
