"""Pretrained Marian (OPUS-MT) models in the transformers layout, read into a fastformer Transformer.

A Marian directory holds config.json, model.safetensors (or pytorch_model.bin), source.spm, target.spm and
vocab.json. Its weights are read with safetensors (or torch.load with weights_only=True) and renamed onto
fastformer's parameters; transformers is never imported. Whatever fastformer cannot represent exactly (a separate
decoder vocabulary, pre-LN, an embedding LayerNorm, learned positions, another activation) is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from fastformer.checkpoint import non_finite_tensor, state_dict_error_line
from fastformer.config import TransformerConfig
from fastformer.data.tokenizer import (EOS_PIECE, PAD_PIECE, UNK_PIECE, MarianTokenizer, Tokenizers,
                                       load_sentencepiece)
from fastformer.model import Transformer, sinusoidal_positions

CONFIG_FILE, VOCAB_FILE, SOURCE_SPM, TARGET_SPM = "config.json", "vocab.json", "source.spm", "target.spm"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# transformers' names for the activations fastformer has.
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
# Settings of older Marian/BART configs that change the network; fastformer takes only the value given here.
FIXED_SETTINGS = {"normalize_before": False, "normalize_embedding": False, "layernorm_embedding": False,
                  "add_final_layer_norm": False, "add_bias_logits": False, "static_position_embeddings": True,
                  "share_encoder_decoder_embeddings": True}
EMBEDDING_NAMES = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
POSITION_NAMES = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")


def load_marian(directory: Path) -> tuple[Transformer, MarianTokenizer, MarianTokenizer]:
    """A Marian directory -> (the model in eval mode on the CPU, its source tokenizer, its target tokenizer)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"Marian model directory not found: {directory}")
    raw = _read_json(_require(directory, CONFIG_FILE))
    if not isinstance(raw, dict):
        raise ValueError(f"{directory / CONFIG_FILE} must hold a JSON object")
    config = marian_config(raw, directory / CONFIG_FILE)
    vocab = _read_vocab(directory, config)
    source, target = (MarianTokenizer(load_sentencepiece(_require(directory, name).read_bytes(), str(directory / name)),
                                      vocab) for name in (SOURCE_SPM, TARGET_SPM))
    weights_path = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if weights_path is None:
        raise FileNotFoundError(f"{directory} holds no weights: neither {' nor '.join(WEIGHT_FILES)}")
    model = Transformer(config)
    state = marian_state_dict(_read_weights(weights_path), config, weights_path)
    name = non_finite_tensor(state)
    if name is not None:
        raise ValueError(f"{weights_path} holds values that are not finite (NaN or inf) in {name}: the file is corrupt")
    try:
        model.load_state_dict(state)
    except RuntimeError as error:  # a weight of another shape than config.json implies
        raise ValueError(f"{weights_path} does not match {directory / CONFIG_FILE}: {state_dict_error_line(error)}"
                         ) from None
    return model.eval(), source, target


def marian_config(raw: dict, path: Path) -> TransformerConfig:
    """A Marian config.json's settings -> the TransformerConfig of the same network; unsupported ones raise a
    ValueError naming them. Optional settings take transformers' MarianConfig defaults."""
    def setting(name: str, default=None, kind: type | tuple[type, ...] = int):
        """raw[name] (absent or null: default; None: required), which must be a `kind` (JSON's true/false are no
        numbers)."""
        value = default if raw.get(name) is None else raw[name]
        if value is None:
            raise ValueError(f"{path} has no {name!r}")
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            expected = {int: "an integer", bool: "true or false", str: "a string"}.get(kind, "a number")
            raise ValueError(f"{path}: {name} is {json.dumps(value)}, not {expected}")
        return value

    def unsupported(what: str) -> ValueError:
        return ValueError(f"{path}: {what} is not supported by fastformer")

    if setting("model_type", "marian", str) != "marian":
        raise unsupported(f"model_type {raw['model_type']!r} (only 'marian')")
    for name, value in FIXED_SETTINGS.items():
        if raw.get(name, value) != value:
            raise unsupported(f"{name}={json.dumps(raw[name])}")
    activation = setting("activation_function", "gelu", str)
    if activation not in ACTIVATIONS:
        raise unsupported(f"activation_function {activation!r} (only {', '.join(ACTIVATIONS)})")
    vocab_size = setting("vocab_size")
    if setting("decoder_vocab_size", vocab_size) != vocab_size:
        raise unsupported(f"a separate decoder vocabulary (decoder_vocab_size={raw['decoder_vocab_size']} != "
                          f"vocab_size={vocab_size})")
    for encoder_name, decoder_name in (("encoder_attention_heads", "decoder_attention_heads"),
                                       ("encoder_ffn_dim", "decoder_ffn_dim")):
        if setting(encoder_name) != setting(decoder_name):
            raise unsupported(f"{encoder_name}={raw[encoder_name]} != {decoder_name}={raw[decoder_name]}")
    d_model, n_heads = setting("d_model"), setting("encoder_attention_heads")
    if n_heads < 1 or d_model % n_heads:
        raise unsupported(f"d_model={d_model!r} not divisible by encoder_attention_heads={n_heads!r}")
    if d_model % 2:
        raise unsupported(f"an odd d_model={d_model} (the [sin | cos] positions need an even one)")
    pad_id, eos_id = setting("pad_token_id"), setting("eos_token_id")
    bad_words = raw.get("bad_words_ids") or []
    if not isinstance(bad_words, list) or any(words != [pad_id] for words in bad_words):
        raise unsupported(f"bad_words_ids={bad_words} (the search bans only the pad token)")
    settings = dict(
        vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_encoder_layers=setting("encoder_layers"),
        n_decoder_layers=setting("decoder_layers"), d_ff=setting("encoder_ffn_dim"),
        dropout=float(setting("dropout", 0.1, (int, float))),
        attention_dropout=float(setting("attention_dropout", 0.0, (int, float))),
        activation=ACTIVATIONS[activation], norm_first=False, tie_embeddings=setting("tie_word_embeddings", True, bool),
        max_positions=setting("max_position_embeddings"), position_layout="halves",
        scale_embedding=setting("scale_embedding", False, bool), output_bias=True,
        pad_id=pad_id, bos_id=setting("decoder_start_token_id", pad_id), eos_id=eos_id)
    try:
        return TransformerConfig(**settings)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None


def marian_state_dict(weights: dict[str, torch.Tensor], config: TransformerConfig,
                      path: Path) -> dict[str, torch.Tensor]:
    """transformers' Marian parameter names -> fastformer's; a missing, misshapen or unplaced weight raises a
    ValueError naming it. q/k/v projections are concatenated into in_proj_weight/bias: Marian scales q by
    head_dim**-0.5 after its projection, fastformer's attention divides the scores by sqrt(head_dim), the same."""
    remaining = dict(weights)

    def take(name: str) -> torch.Tensor:
        if name not in remaining:
            raise ValueError(f"{path} has no weight {name!r}")
        return remaining.pop(name)

    state = {"embed_tokens.weight": _shared_embedding(remaining, path),
             "output_bias": take("final_logits_bias").reshape(-1)}
    output_weight = remaining.pop("lm_head.weight", None)
    if not config.tie_embeddings:
        if output_weight is None:
            raise ValueError(f"{path} has no weight 'lm_head.weight' (tie_word_embeddings is false)")
        state["output_projection.weight"] = output_weight
    elif output_weight is not None and not torch.equal(output_weight, state["embed_tokens.weight"]):
        raise ValueError(f"{path}: lm_head.weight differs from the shared embedding but tie_word_embeddings is true")
    for name in POSITION_NAMES:
        if name in remaining:
            _check_positions(remaining.pop(name), config, name, path)

    def attention(ours: str, theirs: str) -> None:
        for kind in ("weight", "bias"):
            state[f"{ours}.in_proj_{kind}"] = torch.cat([take(f"{theirs}.{p}_proj.{kind}") for p in "qkv"])
            state[f"{ours}.out_proj.{kind}"] = take(f"{theirs}.out_proj.{kind}")

    def copy(ours: str, theirs: str) -> None:
        for kind in ("weight", "bias"):
            state[f"{ours}.{kind}"] = take(f"{theirs}.{kind}")

    for side, n_layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(n_layers):
            ours, theirs = f"{side}.layers.{i}", f"model.{side}.layers.{i}"
            attention(f"{ours}.self_attn", f"{theirs}.self_attn")
            copy(f"{ours}.norm1", f"{theirs}.self_attn_layer_norm")
            copy(f"{ours}.ffn.linear1", f"{theirs}.fc1")
            copy(f"{ours}.ffn.linear2", f"{theirs}.fc2")
            if side == "decoder":
                attention(f"{ours}.multihead_attn", f"{theirs}.encoder_attn")
                copy(f"{ours}.norm2", f"{theirs}.encoder_attn_layer_norm")
            copy(f"{ours}.norm{3 if side == 'decoder' else 2}", f"{theirs}.final_layer_norm")
    if remaining:
        raise ValueError(f"{path} holds weights fastformer has no place for (more layers than the config says, or "
                         f"an unsupported part): {', '.join(sorted(remaining)[:5])}")
    return state


def _shared_embedding(remaining: dict[str, torch.Tensor], path: Path) -> torch.Tensor:
    """The one [vocab, d_model] embedding of both sides; a file keeps any of its tied names, all must agree."""
    found = {name: remaining.pop(name) for name in EMBEDDING_NAMES if name in remaining}
    if not found:
        raise ValueError(f"{path} has no token embedding ({' or '.join(EMBEDDING_NAMES)})")
    first_name, first = next(iter(found.items()))
    for name, tensor in found.items():
        if not torch.equal(tensor, first):
            raise ValueError(f"{path}: {name} differs from {first_name}: separate encoder and decoder embeddings are "
                             f"not supported by fastformer")
    return first


def _check_positions(table: torch.Tensor, config: TransformerConfig, name: str, path: Path) -> None:
    expected = sinusoidal_positions(config.max_positions, config.d_model, "halves")
    if table.shape != expected.shape:
        raise ValueError(f"{path} does not match its config.json: {name} is {tuple(table.shape)}, max_position_"
                         f"embeddings and d_model make {tuple(expected.shape)}")
    # Learned or other positions differ by O(1); the fp32 table differs from transformers' fp64 one by < 1e-4, a
    # table saved in bfloat16 by up to half its epsilon (2^-9 near 1).
    tolerance = max(1e-3, torch.finfo(table.dtype).eps) if table.is_floating_point() else 1e-3
    if not torch.allclose(table.float(), expected, atol=tolerance, rtol=0):
        raise ValueError(f"{path}: {name} is not the [sin | cos] sinusoidal table: learned or non-sinusoidal "
                         "positions are not supported by fastformer")


def _require(directory: Path, name: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a Marian model directory: {name} is missing")
    return path


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def _read_vocab(directory: Path, config: TransformerConfig) -> dict[str, int]:
    """vocab.json: piece -> id over both sides, checked against the model's vocabulary and special ids."""
    if (directory / "target_vocab.json").is_file():
        raise ValueError(f"{directory}: separate source and target vocabularies (target_vocab.json) are not supported "
                         f"by fastformer")
    path = _require(directory, VOCAB_FILE)
    vocab = _read_json(path)
    if not isinstance(vocab, dict) or not all(isinstance(index, int) and not isinstance(index, bool)
                                              for index in vocab.values()):
        raise ValueError(f"{path} must map pieces to integer ids")
    if len(set(vocab.values())) != len(vocab) or not all(0 <= index < config.vocab_size for index in vocab.values()):
        raise ValueError(f"{path} must give distinct ids in [0, vocab_size={config.vocab_size})")
    if UNK_PIECE not in vocab:
        raise ValueError(f"{path} has no {UNK_PIECE!r} piece")
    for piece, index in ((EOS_PIECE, config.eos_id), (PAD_PIECE, config.pad_id)):
        if vocab.get(piece, index) != index:
            raise ValueError(f"{path} gives {piece!r} id {vocab[piece]}, but config.json says {index}")
    if EOS_PIECE not in vocab:
        raise ValueError(f"{path} has no {EOS_PIECE!r} piece")
    return vocab


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors or pytorch_model.bin -> {name: tensor} on the CPU; an unreadable file raises naming it."""
    try:
        if path.suffix == ".safetensors":
            weights = load_file(path, device="cpu")
        else:
            # weights_only: the file holds tensors only, so nothing in it can run code on load.
            weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(f"{path} is not a readable weights file (corrupt or truncated?): "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise ValueError(f"{path} does not hold a flat dict of named tensors")
    return weights


def marian_tokenizers(directory: Path) -> Tokenizers:
    """A Marian directory's source and target tokenizers with their files (what fine-tuning keeps in its prepared
    corpus and checkpoints)."""
    files = {name: _require(directory, name).read_bytes() for name in (SOURCE_SPM, TARGET_SPM, VOCAB_FILE)}
    return Tokenizers.from_files(files, str(directory))
