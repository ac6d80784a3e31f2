"""Tiny Marian models in the transformers layout, built here with random weights (nothing is downloaded): two
sentencepiece models trained on the bundled corpus, a vocab.json joining them as Marian's converter does
(</s> = 0, <unk> = 1, the pieces of both sides, <pad> last), and a MarianMTModel saved with save_pretrained."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import transformers

from fastformer.data import BUNDLED_CORPUS, read_lines



# write_marian's arguments by name; seeds chosen so that make_eos_reachable succeeds.
CONFIGS = {
    "swish-scaled-bias": dict(activation="swish", seed=0),
    "relu-unscaled-nobias": dict(activation="relu", scale_embedding=False, output_bias=False, seed=0),
    "swish-unscaled-bias": dict(activation="swish", scale_embedding=False, seed=3),
    "relu-bin": dict(activation="relu", weights_format="bin", seed=0),
    "gelu-untied": dict(activation="gelu", tie_word_embeddings=False, seed=4),
    "relu-scaled-nobias": dict(activation="relu", output_bias=False, seed=0),
}
SPM_SPECIALS = ("<unk>", "<s>", "</s>")
LANGUAGE_CODE = ">>de<<"  # multilingual OPUS-MT models keep such codes in vocab.json


def train_sentencepiece(sentences: list[str], vocab_size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, num_threads=1, minloglevel=2)
    return model.getvalue()


def joint_vocab(*models: bytes) -> dict[str, int]:
    """Marian's one id space over both sides: </s> = 0, <unk> = 1, each piece once, a language code, <pad> last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for proto in models:
        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(proto)
        for index in range(processor.get_piece_size()):
            piece = processor.id_to_piece(index)
            if piece not in SPM_SPECIALS:
                vocab.setdefault(piece, len(vocab))
    vocab[LANGUAGE_CODE] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


def _tokenizer_files(directory: Path) -> dict[str, int]:
    source = train_sentencepiece(read_lines(BUNDLED_CORPUS / "valid.en"), 60)
    target = train_sentencepiece(read_lines(BUNDLED_CORPUS / "valid.de"), 70)
    (directory / "source.spm").write_bytes(source)
    (directory / "target.spm").write_bytes(target)
    vocab = joint_vocab(source, target)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=2), encoding="utf-8")
    return vocab


def randomize(model, seed: int, output_bias: bool) -> None:
    """Weights large enough that the outputs depend on the input: greedy search then ends at varied lengths (EOS
    is reachable) instead of repeating one token until the length limit."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "embed_positions" in name:  # the fixed sinusoids
                continue
            if "layer_norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                parameter.copy_(base + 0.2 * torch.randn(parameter.shape, generator=generator))
            elif parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 1.5 / parameter.shape[1] ** 0.5)
            else:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
        if output_bias:
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=generator))
        # transformers 5 unties the encoder's and decoder's embeddings too where tie_word_embeddings is false; an
        # untied output projection over one shared embedding (what fastformer represents) keeps them equal.
        for side in (model.model.encoder, model.model.decoder):
            side.embed_tokens.weight.copy_(model.model.shared.weight)


def write_marian(directory: Path, activation: str = "swish", scale_embedding: bool = True, output_bias: bool = True,
                 tie_word_embeddings: bool = True, weights_format: str = "safetensors", seed: int = 0):
    """-> (the transformers MarianMTModel in eval mode, its MarianTokenizer) saved to directory."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer_files(directory)
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
        activation_function=activation, scale_embedding=scale_embedding, dropout=0.0, pad_token_id=pad,
        decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    randomize(model, seed, output_bias)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses": no normalizer is used either way
        tokenizer = transformers.MarianTokenizer(source_spm=str(directory / "source.spm"),
                                                 target_spm=str(directory / "target.spm"),
                                                 vocab=str(directory / "vocab.json"))
    make_eos_reachable(model, tokenizer)
    model.save_pretrained(directory)
    if weights_format == "bin":
        # pytorch_model.bin as older OPUS-MT uploads hold it: every tied name and the position tables saved.
        (directory / "model.safetensors").unlink()
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return model, tokenizer


def greedy(model, tokenizer, sentences: list[str], max_tokens: int) -> list[list[int]]:
    """transformers' greedy search as OPUS-MT configures it (pad banned, EOS forced after max_tokens real tokens)
    -> each sentence's tokens without the start token and EOS."""
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    with torch.no_grad():
        output = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=max_tokens + 1,
                                bad_words_ids=[[pad]], forced_eos_token_id=eos, eos_token_id=eos,
                                pad_token_id=pad, decoder_start_token_id=pad)
    sequences = []
    for row in output[:, 1:].tolist():
        sequences.append(row[:row.index(eos)] if eos in row else row)
    return sequences


CALIBRATION = read_lines(BUNDLED_CORPUS / "valid.en")[:16]
GREEDY_MAX_TOKENS = 30


def make_eos_reachable(model, tokenizer) -> None:
    """Random weights tend to repeat one token up to the length limit; a longer EOS embedding row (tied to the
    output) makes its logit swing with the decoder state, so that greedy search ends at varied lengths. Takes the
    first scale on a grid whose greedy outputs on CALIBRATION have at least 4 lengths, a quarter below the limit."""
    output_weight = model.get_output_embeddings().weight.data
    eos_row = output_weight[model.config.eos_token_id].clone()
    for step in range(37):
        output_weight[model.config.eos_token_id] = eos_row * (1.0 + 0.25 * step)
        lengths = [len(tokens) for tokens in greedy(model, tokenizer, CALIBRATION, GREEDY_MAX_TOKENS)]
        if len(set(lengths)) >= 4 and sum(n < GREEDY_MAX_TOKENS for n in lengths) >= len(lengths) // 4:
            return
    raise AssertionError(f"no EOS scale gives varied greedy lengths for this seed: {lengths}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (directory, transformers model, transformers tokenizer), each built once."""
    cache = {}

    def build(name: str):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            cache[name] = (directory, *write_marian(directory, **CONFIGS[name]))
        return cache[name]
    return build
