"""Tokenizers: the shared English-German sentencepiece BPE vocabulary that fastformer trains, with the special ids the
model's config expects; one side of a Marian (OPUS-MT) model's tokenization; and `Tokenizers`, a model's source and
target tokenizers with the files that make them (what a prepared corpus and a checkpoint keep)."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import sentencepiece as spm

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
TRAINING_SEED = 1
# Fixed, not the machine's core count: the model file records it, so that count would give the same vocabulary other
# bytes on another machine, and a resumed run would find its checkpoint's vocabulary "changed". BPE training takes
# the same time with 2 or 16 threads (a 100k-pair corpus on 2 cores: 4.1 s and 4.0 s).
TRAINING_THREADS = 16
SHARED_FILE = "spm.model"
MARIAN_FILES = ("source.spm", "target.spm", "vocab.json")
EOS_PIECE, UNK_PIECE, PAD_PIECE = "</s>", "<unk>", "<pad>"


class TextTokenizer(Protocol):
    """Text <-> ids without BOS/EOS: fastformer's shared Tokenizer, or one side of a Marian model."""

    def encode(self, sentences: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[list[int]]) -> list[str]: ...

    def pieces(self, ids: list[int]) -> list[str]: ...


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
        return self.processor.encode(sentences, out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.processor.decode(ids)

    def pieces(self, ids: list[int]) -> list[str]:
        """-> the piece of each id, specials included ("</s>" for EOS)."""
        return [self.processor.id_to_piece(index) for index in ids]


def train_tokenizer(sentences: Iterable[str], vocab_size: int = 37000, seed_sentences: int = 2_000_000,
                    reserved: tuple[str, ...] = ()) -> Tokenizer:
    """BPE over the sentences of both languages (the paper: one shared ~37k vocabulary for En-De).

    vocab_size is an upper bound: a small corpus that cannot fill it gets a smaller vocabulary instead of an error.
    reserved: pieces kept whole and apart from the learned ones (sentencepiece's user-defined symbols), such as the
    tag of tagged back-translation.
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
        num_threads=TRAINING_THREADS, minloglevel=2, user_defined_symbols=list(reserved),
    )
    return Tokenizer(model.getvalue())


def load_sentencepiece(proto: bytes, name: str) -> spm.SentencePieceProcessor:
    """A sentencepiece model's bytes -> its processor; a bad one raises a ValueError naming it."""
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto)
    except Exception as error:  # sentencepiece raises bare RuntimeError/OSError for a bad proto
        raise ValueError(f"{name} is not a sentencepiece model: {error}") from None
    return processor


class MarianTokenizer:
    """One side of a Marian model's tokenization, as transformers' MarianTokenizer does it: a sentencepiece model
    splits text into pieces, and vocab.json maps the pieces of both sides to the model's one id space."""

    def __init__(self, processor: spm.SentencePieceProcessor, vocab: dict[str, int]) -> None:
        self.processor = processor
        self.vocab = vocab
        self.pieces_by_id = {index: piece for piece, index in vocab.items()}
        self.unk_id = vocab[UNK_PIECE]
        self.special_ids = {vocab[piece] for piece in (EOS_PIECE, UNK_PIECE, PAD_PIECE) if piece in vocab}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """-> each sentence's ids, without EOS; a leading language code such as ">>de<<" stays one token."""
        return [self._encode(sentence) for sentence in sentences]

    def _encode(self, sentence: str) -> list[int]:
        code: list[str] = []
        if sentence.startswith(">>") and (end := sentence.find("<<")) != -1:
            code, sentence = [sentence[:end + 2]], sentence[end + 2:]
        pieces = code + self.processor.encode(sentence, out_type=str)
        return [self.vocab.get(piece, self.unk_id) for piece in pieces]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """-> the text of each id list; EOS, PAD and UNK are dropped (transformers' skip_special_tokens)."""
        return [self._decode(sentence) for sentence in ids]

    def pieces(self, ids: list[int]) -> list[str]:
        """-> the piece of each id, specials included ("</s>" for EOS)."""
        return [self.pieces_by_id.get(index, UNK_PIECE) for index in ids]

    def _decode(self, ids: list[int]) -> str:
        pieces = self.pieces([index for index in ids if index not in self.special_ids])
        return self.processor.decode_pieces(pieces).replace("\u2581", " ").strip()


@dataclass(frozen=True)
class Tokenizers:
    """A model's source and target tokenizers, and the files that make them (`files`, name -> bytes): fastformer's
    one shared model ({SHARED_FILE}), or a Marian model's two sentencepiece models and their joint vocabulary
    (MARIAN_FILES). special_ids: pad/bos/eos as TransformerConfig names them (a Marian decoder starts from pad).
    reserved: the pieces a shared model was learned with as reserved (train_tokenizer's), which can tag a corpus."""

    source: TextTokenizer
    target: TextTokenizer
    files: dict[str, bytes]
    special_ids: dict[str, int]
    vocab_size: int
    reserved: tuple[str, ...] = ()

    @classmethod
    def shared(cls, tokenizer: Tokenizer, reserved: tuple[str, ...] = ()) -> Tokenizers:
        return cls(tokenizer, tokenizer, {SHARED_FILE: tokenizer.model_proto}, tokenizer.special_ids,
                   tokenizer.vocab_size, reserved)

    @classmethod
    def from_files(cls, files: dict[str, bytes], where: str, reserved: tuple[str, ...] = ()) -> Tokenizers:
        """The tokenizers of files as `files` holds them (from a prepared corpus, a checkpoint or a Marian directory,
        named by `where` in errors); reserved: a shared model's reserved pieces."""
        if set(files) == {SHARED_FILE}:
            try:
                return cls.shared(Tokenizer(files[SHARED_FILE]), reserved)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
        if set(files) != set(MARIAN_FILES):
            raise ValueError(f"{where} holds the tokenizer files {sorted(files)}: neither {SHARED_FILE!r} nor "
                             f"{', '.join(MARIAN_FILES)}")
        vocab = marian_vocab(files["vocab.json"], f"{where}: vocab.json")
        source, target = (MarianTokenizer(load_sentencepiece(files[name], f"{where}: {name}"), vocab)
                          for name in MARIAN_FILES[:2])
        return cls(source, target, dict(files), {"pad_id": vocab[PAD_PIECE], "bos_id": vocab[PAD_PIECE],
                                                 "eos_id": vocab[EOS_PIECE]}, max(vocab.values()) + 1)

    def reserved_id(self, piece: str, origin: str) -> int:
        """The id of a reserved piece (no ordinary text encodes to it: one of a shared model's `reserved`, or a Marian
        vocabulary entry that is no source piece, such as a language code); an ordinary piece, or one the vocabulary
        lacks, is an error naming it and origin (whose vocabulary it is)."""
        processor = self.source.processor
        if isinstance(self.source, Tokenizer):
            index = processor.piece_to_id(piece)
            known = processor.id_to_piece(index) == piece
            ordinary = known and piece not in self.reserved
        else:
            index = self.source.vocab.get(piece, -1)
            known = index >= 0
            ordinary = known and processor.id_to_piece(processor.piece_to_id(piece)) == piece
        if known and (index in self.special_ids.values() or piece in (UNK_PIECE, EOS_PIECE, PAD_PIECE)):
            raise ValueError(f"{piece!r} is a special token of {origin} (pad, bos, eos or unk), which the model reads "
                             "as such: choose a reserved piece")
        if ordinary:
            raise ValueError(f"{piece!r} collides with the vocabulary piece {piece!r} (id {index}) of {origin}: text "
                             f"encodes to it, so it cannot tag a corpus; choose a reserved one")
        if not known:
            raise ValueError(f"{piece!r} is not in the vocabulary of {origin}, which cannot grow: choose one of its "
                             f"reserved pieces")
        return index

    @property
    def digest(self) -> str:
        """Names these tokenizers (a prepared corpus is keyed by it)."""
        return hashlib.sha256(b"".join(hashlib.sha256(self.files[name]).digest()
                                       for name in sorted(self.files))).hexdigest()

    @property
    def checkpoint_entry(self) -> bytes | dict[str, bytes]:
        """What a checkpoint keeps: the shared model's bytes (as checkpoints always held), or the Marian files."""
        return self.files[SHARED_FILE] if SHARED_FILE in self.files else dict(self.files)

    @classmethod
    def from_checkpoint_entry(cls, entry: bytes | dict[str, bytes], where: str,
                              reserved: tuple[str, ...] = ()) -> Tokenizers:
        return cls.from_files(entry if isinstance(entry, dict) else {SHARED_FILE: entry}, where, reserved)


def marian_vocab(data: bytes, where: str) -> dict[str, int]:
    """A Marian vocab.json: piece -> id over both sides, with distinct ids and the <unk>, </s> and <pad> pieces."""
    try:
        vocab = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where} is not valid JSON: {error}") from None
    if not isinstance(vocab, dict) or not all(isinstance(index, int) and not isinstance(index, bool)
                                              for index in vocab.values()):
        raise ValueError(f"{where} must map pieces to integer ids")
    if len(set(vocab.values())) != len(vocab) or min(vocab.values(), default=0) < 0:
        raise ValueError(f"{where} must give each piece a distinct id >= 0")
    for piece in (UNK_PIECE, EOS_PIECE, PAD_PIECE):
        if piece not in vocab:
            raise ValueError(f"{where} has no {piece!r} piece")
    return vocab
