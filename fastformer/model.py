"""The encoder-decoder Transformer of "Attention Is All You Need", built from fastformer's drop-in modules.

Parameter names follow `torch.nn.Transformer` (encoder.layers.0.self_attn.in_proj_weight, ...), so weights move
between the two. Batches are right-padded with pad_id; the padding is carried as per-sequence lengths, checked once
per batch (`Transformer.lengths`), so the layers' attention calls never wait on the GPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fastformer.config import TransformerConfig
from fastformer.decoding import compiled, scoring, search
from fastformer.decoding.shortlist import Shortlist
from fastformer.nn import LinearCrossEntropyLoss, MultiheadAttention, ResidualLayerNorm


class EncoderOutput(NamedTuple):
    memory: torch.Tensor  # [batch, src_len, d_model]
    src_lengths: torch.Tensor  # [batch]


def sinusoidal_positions(max_positions: int, d_model: int, layout: str = "interleaved") -> torch.Tensor:
    """-> [max_positions, d_model]: sines and cosines of wavelengths 2pi .. 10000*2pi, either interleaved (sin on
    even channels, cos on odd ones, as in the paper) or as halves [sin | cos] (as in Marian and fairseq)."""
    position = torch.arange(max_positions, dtype=torch.float32)[:, None]
    inv_frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    sin, cos = torch.sin(position * inv_frequency), torch.cos(position * inv_frequency)
    if layout == "halves":
        return torch.cat([sin, cos], dim=1)
    table = torch.zeros(max_positions, d_model)
    table[:, 0::2] = sin
    table[:, 1::2] = cos
    return table


class FeedForward(nn.Module):
    """x: [..., d_model] -> linear2(activation(linear1(x))): [..., d_model]."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.linear1 = nn.Linear(config.d_model, config.d_ff)
        self.linear2 = nn.Linear(config.d_ff, config.d_model)
        self.activation = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each closed by a fused residual(+dropout)+LayerNorm."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        d, p = config.d_model, config.dropout
        self.norm_first = config.norm_first
        self.self_attn = MultiheadAttention(d, config.n_heads, dropout=config.attention_dropout, batch_first=True)
        self.ffn = FeedForward(config)
        self.norm1 = ResidualLayerNorm(d, dropout=p)
        self.norm2 = ResidualLayerNorm(d, dropout=p)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """x: [batch, len, d_model], lengths: [batch] -> [batch, len, d_model]."""
        def attend(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, h, h, query_lengths=lengths, key_lengths=lengths, check_lengths=False)[0]

        if self.norm_first:
            h, x = self.norm2(attend(self.norm1(x)), x, return_sum=True)
            return x + self.dropout(self.ffn(h))
        x = self.norm1(attend(x), x)
        return self.norm2(self.ffn(x), x)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the encoder's memory, feed-forward; fused residual+LayerNorms."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        d, p = config.d_model, config.dropout
        self.norm_first = config.norm_first
        self.self_attn = MultiheadAttention(d, config.n_heads, dropout=config.attention_dropout, batch_first=True)
        self.multihead_attn = MultiheadAttention(d, config.n_heads, dropout=config.attention_dropout, batch_first=True)
        self.ffn = FeedForward(config)
        self.norm1 = ResidualLayerNorm(d, dropout=p)
        self.norm2 = ResidualLayerNorm(d, dropout=p)
        self.norm3 = ResidualLayerNorm(d, dropout=p)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor, tgt_lengths: torch.Tensor, encoder_out: EncoderOutput) -> torch.Tensor:
        """x: [batch, tgt_len, d_model], tgt_lengths: [batch] -> [batch, tgt_len, d_model]."""
        memory, src_lengths = encoder_out

        def attend_self(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, h, h, is_causal=True, query_lengths=tgt_lengths, key_lengths=tgt_lengths,
                                  check_lengths=False)[0]

        def attend_source(h: torch.Tensor) -> torch.Tensor:
            return self.multihead_attn(h, memory, memory, query_lengths=tgt_lengths, key_lengths=src_lengths,
                                       check_lengths=False)[0]

        if self.norm_first:
            h, x = self.norm2(attend_self(self.norm1(x)), x, return_sum=True)
            h, x = self.norm3(attend_source(h), x, return_sum=True)
            return x + self.dropout(self.ffn(h))
        x = self.norm1(attend_self(x), x)
        x = self.norm2(attend_source(x), x)
        return self.norm3(self.ffn(x), x)


class Encoder(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        # Pre-LN leaves the residual stream unnormalized, so it ends with one more LayerNorm (post-LN does not).
        self.norm = nn.LayerNorm(config.d_model) if config.norm_first else None

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, lengths)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        self.norm = nn.LayerNorm(config.d_model) if config.norm_first else None

    def forward(self, x: torch.Tensor, tgt_lengths: torch.Tensor, encoder_out: EncoderOutput) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, tgt_lengths, encoder_out)
        return self.norm(x) if self.norm is not None else x


class Transformer(nn.Module):
    """Encoder-decoder Transformer with sinusoidal positions and a shared, sqrt(d_model)-scaled embedding."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        self.register_buffer("positions", sinusoidal_positions(config.max_positions, config.d_model,
                                                               config.position_layout), persistent=False)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.output_projection = (None if config.tie_embeddings
                                  else nn.Linear(config.d_model, config.vocab_size, bias=False))
        self.output_bias = nn.Parameter(torch.zeros(config.vocab_size)) if config.output_bias else None
        self.reset_parameters()

    def _apply(self, fn, recurse: bool = True):
        """Casts and moves as nn.Module does, then makes the position table anew in its new dtype and device: it is
        computed, not learned (nor saved), and a cast there and back (half() then float()) would keep half's rounding,
        where a model loaded from the same state_dict has none."""
        super()._apply(fn, recurse)
        self.positions = sinusoidal_positions(self.config.max_positions, self.config.d_model,
                                              self.config.position_layout).to(self.positions.device,
                                                                              self.positions.dtype)
        return self

    def reset_parameters(self) -> None:
        """Xavier for every matrix (as torch.nn.Transformer), N(0, d^-1/2) embeddings with a zero padding row."""
        for name, parameter in self.named_parameters():
            if parameter.dim() > 1 and not name.startswith("embed_tokens"):
                nn.init.xavier_uniform_(parameter)
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=self.config.d_model ** -0.5)
        with torch.no_grad():
            self.embed_tokens.weight[self.config.pad_id].zero_()

    @property
    def output_weight(self) -> torch.Tensor:
        """[vocab, d_model]: the tied embedding or the separate output projection."""
        return self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight

    def lengths(self, tokens: torch.Tensor, name: str, starts_with_bos: bool = False) -> torch.Tensor:
        """tokens: [batch, len] right-padded ids -> lengths [batch]; rejects every malformed batch by name.

        starts_with_bos: the tokens are a decoder input, whose first position is BOS and real even where
        bos_id == pad_id (Marian starts its decoder from the pad token)."""
        (lengths,) = self._checked_lengths((tokens, name, starts_with_bos))
        return lengths

    def _checked_lengths(self, *named_tokens: tuple[torch.Tensor, str, bool], targets: torch.Tensor | None = None,
                         targets_for_mean: bool = False) -> list[torch.Tensor]:
        """The lengths of each (tokens [batch, len], name, starts_with_bos), and every check of them and of
        `targets` (tgt_out [batch, len], aligned with the last of named_tokens, tgt_in), with one host sync for all:
        the layers and the loss then trust them and never wait on the GPU.

        targets_for_mean: the loss is a mean over the real target tokens, so there must be at least one."""
        lengths, problems, messages = [], [], []
        for tokens, name, starts_with_bos in named_tokens:
            self._check_token_tensor(tokens, name)
            is_pad = tokens == self.config.pad_id
            if starts_with_bos and self.config.bos_id == self.config.pad_id:
                is_pad[:, 0] = False
            length = (~is_pad).sum(dim=1)
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            problems += [self._out_of_vocabulary(tokens),
                         (is_pad != (positions[None, :] >= length[:, None])).any(),
                         (length == 0).any()]
            messages += [f"{name} holds ids outside [0, vocab_size={self.config.vocab_size})",
                         f"{name} must be right-padded: pad_id={self.config.pad_id} only after the last real token",
                         f"{name} has a sequence that is all padding"]
            lengths.append(length)
        if targets is not None:
            self._check_token_tensor(targets, "tgt_out")
            is_target = targets != self.config.pad_id
            # A target whose decoder input is padding has no hidden state to be predicted from.
            beyond_input = positions[None, :] >= length[:, None]
            problems += [self._out_of_vocabulary(targets), (is_target & beyond_input).any()]
            messages += [f"tgt_out holds ids outside [0, vocab_size={self.config.vocab_size})",
                         "tgt_out has a real token where tgt_in is padding: each target needs its decoder input"]
            if targets_for_mean:
                problems.append(~is_target.any())
                messages.append("tgt_out is all padding: the mean loss over zero target tokens is undefined "
                                "(reduction='sum' gives 0.0)")
        for found, message in zip(torch.stack(problems).tolist(), messages):
            if found:
                raise ValueError(message)
        return lengths

    def _check_token_tensor(self, tokens: torch.Tensor, name: str) -> None:
        """Type, dtype, shape and device of a [batch, len] tensor of token ids (no host sync)."""
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must hold int64 or int32 token ids, got {tokens.dtype}")
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"{name} must have shape [batch, len] with len >= 1, got {tuple(tokens.shape)}")
        if tokens.shape[1] > self.config.max_positions:
            raise ValueError(f"{name} has length {tokens.shape[1]} > max_positions={self.config.max_positions}")
        if tokens.device != self.embed_tokens.weight.device:
            raise ValueError(f"{name} is on {tokens.device} but the model is on {self.embed_tokens.weight.device}")

    def _out_of_vocabulary(self, tokens: torch.Tensor) -> torch.Tensor:
        return ((tokens < 0) | (tokens >= self.config.vocab_size)).any()

    @property
    def embedding_scale(self) -> float:
        return math.sqrt(self.config.d_model) if self.config.scale_embedding else 1.0

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [batch, len] -> dropout(embedding * embedding_scale + positions): [batch, len, d_model]."""
        x = self.embed_tokens(tokens) * self.embedding_scale + self.positions[: tokens.shape[1]]
        return self.embed_dropout(x)

    def encode(self, src_tokens: torch.Tensor) -> EncoderOutput:
        """src_tokens: [batch, src_len] -> EncoderOutput(memory [batch, src_len, d_model], src_lengths [batch])."""
        return self._encode(src_tokens, self.lengths(src_tokens, "src_tokens"))

    def _encode(self, src_tokens: torch.Tensor, src_lengths: torch.Tensor) -> EncoderOutput:
        return EncoderOutput(self.encoder(self.embed(src_tokens), src_lengths), src_lengths)

    def decode_hidden(self, tgt_tokens: torch.Tensor, encoder_out: EncoderOutput) -> torch.Tensor:
        """tgt_tokens: [batch, tgt_len] -> the decoder's last hidden states [batch, tgt_len, d_model]."""
        return self._decode_hidden(tgt_tokens, self.lengths(tgt_tokens, "tgt_tokens", starts_with_bos=True),
                                   encoder_out)

    def _decode_hidden(self, tgt_tokens: torch.Tensor, tgt_lengths: torch.Tensor,
                       encoder_out: EncoderOutput) -> torch.Tensor:
        if tgt_tokens.shape[0] != encoder_out.memory.shape[0]:
            raise ValueError(f"tgt_tokens has batch {tgt_tokens.shape[0]} but the encoder output has "
                             f"{encoder_out.memory.shape[0]}")
        return self.decoder(self.embed(tgt_tokens), tgt_lengths, encoder_out)

    def decode(self, tgt_tokens: torch.Tensor, encoder_out: EncoderOutput) -> torch.Tensor:
        """tgt_tokens: [batch, tgt_len] -> logits [batch, tgt_len, vocab]."""
        return F.linear(self.decode_hidden(tgt_tokens, encoder_out), self.output_weight, self.output_bias)

    def forward(self, src_tokens: torch.Tensor, tgt_tokens: torch.Tensor) -> torch.Tensor:
        """src_tokens: [batch, src_len], tgt_tokens: [batch, tgt_len] -> logits [batch, tgt_len, vocab]."""
        return self.decode(tgt_tokens, self.encode(src_tokens))

    def loss(self, src_tokens: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor,
             label_smoothing: float = 0.0, reduction: str = "mean",
             lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Teacher-forced label-smoothed cross-entropy; tgt_in = [bos, y...], tgt_out = [y..., eos], both [batch, T].

        The output projection is fused into the loss, so the [batch * T, vocab] logits are never held whole.
        Padding positions of tgt_out (pad_id) are ignored. All three tensors are checked with one host sync; a real
        tgt_out token where tgt_in is padding is an error, and so is reduction="mean" over a tgt_out that is all
        padding (PyTorch's mean would be NaN there): "sum" gives 0.0 and "none" zeros for it.

        lengths: (src_lengths, tgt_lengths) [batch] on the model's device, already checked by the caller (as
        `TokenizedCorpus.batch` does on the CPU): the values are trusted and not checked, so no host sync happens.
        """
        if not isinstance(tgt_out, torch.Tensor) or tgt_out.shape != tgt_in.shape:
            raise ValueError(f"tgt_out must be a tensor of tgt_in's shape {tuple(tgt_in.shape)}, got "
                             f"{tuple(tgt_out.shape) if isinstance(tgt_out, torch.Tensor) else type(tgt_out).__name__}")
        if lengths is None:
            src_lengths, tgt_lengths = self._checked_lengths((src_tokens, "src_tokens", False),
                                                             (tgt_in, "tgt_in", True), targets=tgt_out,
                                                             targets_for_mean=reduction == "mean")
        else:
            for tokens, name in ((src_tokens, "src_tokens"), (tgt_in, "tgt_in"), (tgt_out, "tgt_out")):
                self._check_token_tensor(tokens, name)
            src_lengths, tgt_lengths = lengths
        hidden = self._decode_hidden(tgt_in, tgt_lengths, self._encode(src_tokens, src_lengths))
        criterion = LinearCrossEntropyLoss(ignore_index=self.config.pad_id, label_smoothing=label_smoothing,
                                           reduction=reduction, check_targets=False)
        return criterion(hidden, self.output_weight, tgt_out, bias=self.output_bias)

    @torch.no_grad()
    def translate(self, src_tokens: torch.Tensor, beam_size: int = 4, length_penalty: float = 0.6,
                  max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 1, n_best: int = 1,
                  length_penalty_form: str = "gnmt", shrink: str = "auto", compute_type: str | None = None,
                  return_scores: bool = True, sampling_topk: int = 1, sampling_topp: float = 1.0,
                  sampling_temperature: float = 1.0, seed: int = 0,
                  target_prefix: list[list[int] | None] | None = None, no_repeat_ngram_size: int = 0,
                  repetition_penalty: float = 1.0, return_attention: bool = False,
                  shortlist: Shortlist | None = None) -> list[list[search.Hypothesis]]:
        """src_tokens: [batch, src_len] right-padded -> per sentence, its n_best hypotheses, best first.

        Incremental beam search with a KV cache in the compiled extension; beam_size=1 is greedy search. `shrink`:
        how the batch shrinks as sentences finish, which changes speed only (fastformer/decoding/search.py).
        `compute_type`: the linear layers' type, "float32", "bfloat16", "int8" (CPU), "float16" (CUDA) or "auto";
        None: the model's dtype (fastformer/decoding/compiled.py). The converted weights are kept until a parameter
        changes. `return_scores=False`: each Hypothesis.score is None, and greedy search on the CPU takes each step's
        argmax without a log-softmax. `return_attention=True`: each Hypothesis.attention is its alignment, the last
        decoder layer's cross-attention averaged over heads, [len(tokens) + 1, src_length] float32 on the CPU (one
        row per output token, EOS last; fastformer.decoding.alignment.hard_alignment makes fairseq's pairs of it).

        As CTranslate2's options: `sampling_topk` (1: no sampling, 0: the whole vocabulary), `sampling_topp`,
        `sampling_temperature` and `seed` sample with beam_size 1, n_best=N giving N independent samples;
        `target_prefix` (per sentence a list of ids without BOS/EOS, or None) is forced, then the search goes on;
        `no_repeat_ngram_size` (0: off) and `repetition_penalty` (1.0: off) act on each hypothesis's tokens so far.
        `shortlist` (CPU; CTranslate2's vocabulary map): each batch's output vocabulary restricted to its sources'
        likely target ids (fastformer/decoding/shortlist.py).
        """
        return search.translate(self, src_tokens, beam_size=beam_size, length_penalty=length_penalty,
                                  max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len, n_best=n_best,
                                  length_penalty_form=length_penalty_form, shrink=shrink, compute_type=compute_type,
                                  return_scores=return_scores, sampling_topk=sampling_topk,
                                  sampling_topp=sampling_topp, sampling_temperature=sampling_temperature, seed=seed,
                                  target_prefix=target_prefix, no_repeat_ngram_size=no_repeat_ngram_size,
                                  repetition_penalty=repetition_penalty, return_attention=return_attention,
                                  shortlist=shortlist)

    @torch.no_grad()
    def score(self, src_tokens: torch.Tensor, target_tokens: list[list[int]] | torch.Tensor,
              compute_type: str | None = None) -> list[torch.Tensor]:
        """src_tokens: [batch, src_len] right-padded; target_tokens: per sentence its ids without EOS (or a
        [batch, tgt_len] tensor right-padded with pad_id, its padding not scored) -> per sentence
        a [len(target) + 1] float32 tensor: the log-probability of each target token and of EOS under teacher forcing
        (CTranslate2's score_batch), the decoder run once over all positions in the compiled extension.

        `compute_type` as in `translate` (fastformer/decoding/compiled.py). A count of targets other than the batch's,
        an empty target, an id that is not an integer in the vocabulary or a target over max_positions - 1 tokens is an
        error naming it.
        """
        return scoring.score(self, src_tokens, target_tokens, compute_type=compute_type)

    def forget_compiled(self) -> None:
        """Drops the converted weights `translate` and `score` keep, so that the next call converts the parameters
        again. Needed only after edits torch's version counters do not see: through `.data`, or of parameters made
        under torch.inference_mode() (fastformer/decoding/compiled.py)."""
        compiled.forget(self)
