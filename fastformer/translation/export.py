"""Export a fastformer model to CTranslate2, the engine people deploy Transformer translation with.

`to_ctranslate2(model, tokenizer, out_dir)` fills CTranslate2's `TransformerSpec` from the model's weights and
writes a directory that `ctranslate2.Translator(out_dir)` loads. Needs the optional `ctranslate2` package
(`pip install .[ctranslate2]`).

CTranslate2 speaks token strings: the vocabulary is written so that string i is fastformer's id i, with the
special pieces at the config's pad/bos/eos ids. The exported model appends EOS to each source itself (as fastformer's
data pipeline does) and starts the decoder from the BOS piece, so its inputs are the tokenizer's pieces, without
specials. The weights give the same log-probabilities as fastformer (`Translator.score_batch`). Search differs in
what CTranslate2 leaves to its call: fastformer bars PAD and BOS and EOS before `min_len` after its log-softmax,
CTranslate2 only EOS before `min_decoding_length`, and before its softmax; its `length_penalty` divides by the
length to the power alpha, not by the GNMT penalty.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fastformer.checkpoint import current_umask
from fastformer.data.tokenizer import MarianTokenizer, Tokenizer
from fastformer.model import Transformer
from fastformer.nn import ResidualLayerNorm

QUANTIZATIONS = ("float32", "float16", "bfloat16", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16")


def to_ctranslate2(model: Transformer, tokenizer: Tokenizer | MarianTokenizer | Sequence[str], out_dir: str | Path,
                   quantization: str = "float32") -> Path:
    """Writes `model` as a CTranslate2 Transformer to out_dir (created; an existing model there is replaced, and only
    once the new one is whole: a failed write, a full disk say, leaves out_dir as it was).

    tokenizer: fastformer's Tokenizer, a Marian model's (its joint vocabulary, shared by both sides), or the token
    strings themselves (string i for id i, all distinct).
    quantization: how CTranslate2 stores the weights (one of QUANTIZATIONS). -> out_dir.
    """
    ctranslate2 = _import_ctranslate2()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a fastformer.Transformer, got {type(model).__name__}")
    tokens = vocabulary(tokenizer)
    config = model.config
    if len(tokens) != config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokens)} pieces but the model's vocab_size is {config.vocab_size}")
    spec = ctranslate2.specs.TransformerSpec.from_config(
        (config.n_encoder_layers, config.n_decoder_layers), config.n_heads, pre_norm=config.norm_first,
        activation=_activation(ctranslate2, config.activation))
    _set_encoder(spec.encoder, model)
    _set_decoder(spec.decoder, model)
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    if "<unk>" not in tokens:
        raise ValueError("the vocabulary has no '<unk>' piece, which CTranslate2 needs for unknown source words")
    spec.config.unk_token = "<unk>"
    spec.config.bos_token = tokens[config.bos_id]
    spec.config.eos_token = tokens[config.eos_id]
    spec.config.decoder_start_token = tokens[config.bos_id]
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = _layer_norm_epsilon(model)
    spec.validate()
    spec.optimize(quantization=quantization)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        spec.save(str(staging))
    except BaseException as error:
        written = sum(path.stat().st_size for path in staging.iterdir())
        shutil.rmtree(staging)
        if not isinstance(error, OSError):
            raise
        free = shutil.disk_usage(out_dir.parent).free
        raise OSError(error.errno, f"cannot write the CTranslate2 model {out_dir}: {error.strerror or error} after "
                                   f"{written:,} bytes, with {free:,} free in {out_dir.parent}; {out_dir} is as it "
                                   "was") from None
    _move_into(staging, out_dir)
    return out_dir


def _move_into(staging: Path, out_dir: Path) -> None:
    """Moves a written model's files from staging into out_dir (each rename atomic, and needing no space), then
    removes staging; a new out_dir is staging renamed."""
    # mkdtemp makes the directory private (0700); an exported model gets the permissions of any directory made.
    os.chmod(staging, 0o777 & ~current_umask())
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    for path in staging.iterdir():
        os.replace(path, out_dir / path.name)
    staging.rmdir()


def vocabulary(tokenizer: Tokenizer | MarianTokenizer | Sequence[str]) -> list[str]:
    """The token string of each id: the tokenizer's pieces, or the given strings; rejects duplicates (CTranslate2
    maps strings to ids, so two equal strings would make one id unreachable)."""
    if isinstance(tokenizer, Tokenizer):
        processor = tokenizer.processor
        tokens = [processor.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    elif isinstance(tokenizer, MarianTokenizer):
        missing = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.pieces_by_id]
        if missing:
            raise ValueError(f"the Marian vocabulary has no piece for ids {missing[:5]}: CTranslate2 needs one per id")
        tokens = [tokenizer.pieces_by_id[i] for i in range(tokenizer.vocab_size)]
    elif isinstance(tokenizer, Sequence) and not isinstance(tokenizer, str):
        tokens = list(tokenizer)
        if not all(isinstance(token, str) and token for token in tokens):
            raise TypeError("a vocabulary given as a sequence must hold non-empty strings")
    else:
        raise TypeError(f"tokenizer must be a fastformer Tokenizer, a MarianTokenizer or a sequence of token strings, "
                        f"got {type(tokenizer).__name__}")
    seen: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in seen:
            raise ValueError(f"token {token!r} appears twice in the vocabulary (ids {seen[token]} and {index})")
        seen[token] = index
    return tokens


def _import_ctranslate2():
    try:
        import ctranslate2
        import ctranslate2.specs  # noqa: F401 - the spec classes live in a submodule
    except ImportError as error:
        raise ModuleNotFoundError("exporting to CTranslate2 needs the ctranslate2 package: "
                           "`pip install ctranslate2` or `pip install .[ctranslate2]`") from error
    return ctranslate2


def _activation(ctranslate2, name: str):
    activations = ctranslate2.specs.common_spec.Activation
    # fastformer's "gelu" is F.gelu's exact erf form, CTranslate2's GELU (not GELUTanh); "swish" is SiLU.
    return {"relu": activations.RELU, "gelu": activations.GELU, "swish": activations.SWISH}[name]


def _layer_norm_epsilon(model: Transformer) -> float:
    """CTranslate2 takes one epsilon for all its LayerNorms."""
    epsilons = {float(module.eps) for module in model.modules() if isinstance(module, (ResidualLayerNorm, nn.LayerNorm))}
    if len(epsilons) != 1:
        raise ValueError(f"CTranslate2 takes one LayerNorm epsilon for the whole model, this one has {sorted(epsilons)}")
    return epsilons.pop()


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


def _set_linear(spec, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = _array(weight)
    if bias is not None:
        spec.bias = _array(bias)


def _set_norm(spec, norm) -> None:
    spec.gamma = _array(norm.weight)
    spec.beta = _array(norm.bias)


def _set_attention(spec, attention, self_attention: bool) -> None:
    """fastformer's [q | k | v] in_proj is CTranslate2's fused qkv (self-attention), or its q and fused kv."""
    weight, bias = attention.in_proj_weight, attention.in_proj_bias
    if self_attention:
        _set_linear(spec.linear[0], weight, bias)
    else:
        d = weight.shape[1]
        _set_linear(spec.linear[0], weight[:d], None if bias is None else bias[:d])
        _set_linear(spec.linear[1], weight[d:], None if bias is None else bias[d:])
    _set_linear(spec.linear[-1], attention.out_proj.weight, attention.out_proj.bias)


def _set_ffn(spec, ffn) -> None:
    _set_linear(spec.linear_0, ffn.linear1.weight, ffn.linear1.bias)
    _set_linear(spec.linear_1, ffn.linear2.weight, ffn.linear2.bias)


def _set_inputs(spec, model: Transformer, embeddings_spec) -> None:
    embeddings_spec.weight = _array(model.embed_tokens.weight)
    spec.scale_embeddings = model.config.scale_embedding
    # CTranslate2's default table is [sin | cos]; fastformer's may be interleaved, so its own table is written.
    spec.position_encodings.encodings = _array(model.positions)


def _set_encoder(spec, model: Transformer) -> None:
    _set_inputs(spec, model, spec.embeddings[0])
    for layer_spec, layer in zip(spec.layer, model.encoder.layers):
        _set_attention(layer_spec.self_attention, layer.self_attn, self_attention=True)
        _set_norm(layer_spec.self_attention.layer_norm, layer.norm1)
        _set_ffn(layer_spec.ffn, layer.ffn)
        _set_norm(layer_spec.ffn.layer_norm, layer.norm2)
    if model.encoder.norm is not None:
        _set_norm(spec.layer_norm, model.encoder.norm)


def _set_decoder(spec, model: Transformer) -> None:
    _set_inputs(spec, model, spec.embeddings)
    _set_linear(spec.projection, model.output_weight, model.output_bias)
    for layer_spec, layer in zip(spec.layer, model.decoder.layers):
        _set_attention(layer_spec.self_attention, layer.self_attn, self_attention=True)
        _set_norm(layer_spec.self_attention.layer_norm, layer.norm1)
        _set_attention(layer_spec.attention, layer.multihead_attn, self_attention=False)
        _set_norm(layer_spec.attention.layer_norm, layer.norm2)
        _set_ffn(layer_spec.ffn, layer.ffn)
        _set_norm(layer_spec.ffn.layer_norm, layer.norm3)
    if model.decoder.norm is not None:
        _set_norm(spec.layer_norm, model.decoder.norm)
