"""The PyTorch baselines users would otherwise write, for the benchmarks to beat.

- `TorchTransformer`: the same model built from torch.nn.TransformerEncoder/DecoderLayer (whose attention is
  F.scaled_dot_product_attention with boolean masks), a tied embedding + output projection and
  F.cross_entropy(label_smoothing=...): the training baseline.
- `CachedDecoder` + `cached_beam_search`: a fastformer model's weights decoded incrementally the usual way, as
  Hugging Face's generate does: a per-step Python loop, SDPA over a per-layer key/value cache grown with torch.cat
  and reordered with index_select, cross-attention keys/values computed once and copied per beam, one host sync per
  step for the bookkeeping. It follows the scoring rules of fastformer/reference/beam_search.py exactly, so that it
  returns the same hypotheses; finished sentences stay in the batch until its longest ends (no compaction; fairseq's
  SequenceGenerator removes them, and would do less work at batches of mixed lengths).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cpu_info import cpu_name_and_flags
from fastformer import Transformer, TransformerConfig
from fastformer.model import sinusoidal_positions
from fastformer.reference.beam_search import (Hypothesis, check_search_arguments, length_penalty_divisor,
                                              max_target_lengths)


class TorchTransformer(nn.Module):
    """fastformer's model rebuilt from torch.nn's Transformer layers: same sizes, tied embeddings, sinusoids."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed_tokens = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_id)
        self.register_buffer("positions", sinusoidal_positions(config.max_positions, d), persistent=False)
        self.embed_dropout = nn.Dropout(config.dropout)
        layer_options = dict(d_model=d, nhead=config.n_heads, dim_feedforward=config.d_ff, dropout=config.dropout,
                             activation=config.activation, batch_first=True, norm_first=config.norm_first)
        # Post-LN ends each layer normalized; pre-LN needs the final LayerNorm (as fastformer has).
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer_options), config.n_encoder_layers,
                                             norm=nn.LayerNorm(d) if config.norm_first else None,
                                             enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer_options), config.n_decoder_layers,
                                             norm=nn.LayerNorm(d) if config.norm_first else None)
        # torch's layers use the residual dropout on the attention weights too; match fastformer's config instead.
        for module in self.modules():
            if isinstance(module, nn.MultiheadAttention):
                module.dropout = config.attention_dropout
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=d ** -0.5)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens) * math.sqrt(self.config.d_model) + self.positions[: tokens.shape[1]]
        return self.embed_dropout(x)

    def forward(self, src_tokens: torch.Tensor, tgt_tokens: torch.Tensor) -> torch.Tensor:
        """src_tokens: [batch, src_len], tgt_tokens: [batch, tgt_len] -> logits [batch, tgt_len, vocab]."""
        pad = self.config.pad_id
        src_padding, tgt_padding = src_tokens == pad, tgt_tokens == pad
        tgt_len = tgt_tokens.shape[1]
        causal = torch.ones(tgt_len, tgt_len, dtype=torch.bool, device=tgt_tokens.device).triu(1)
        memory = self.encoder(self.embed(src_tokens), src_key_padding_mask=src_padding)
        hidden = self.decoder(self.embed(tgt_tokens), memory, tgt_mask=causal, tgt_key_padding_mask=tgt_padding,
                              memory_key_padding_mask=src_padding, tgt_is_causal=True)
        return F.linear(hidden, self.embed_tokens.weight)

    def loss(self, src_tokens: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor,
             label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
        """Teacher-forced F.cross_entropy over the full [batch * T, vocab] logits; PAD targets ignored."""
        logits = self(src_tokens, tgt_in)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt_out.reshape(-1), ignore_index=self.config.pad_id,
                               label_smoothing=label_smoothing, reduction=reduction)


# ---------------------------------------------------------------------------------------------------------------------
# The cached decoder


@dataclass
class DecoderState:
    """The incremental decoder's cache for N = batch * beam rows."""

    self_keys: list[torch.Tensor]  # per layer [N, heads, steps so far, head_dim]
    self_values: list[torch.Tensor]
    cross_keys: list[torch.Tensor]  # per layer [N, heads, src_len, head_dim]
    cross_values: list[torch.Tensor]
    source_keep: torch.Tensor  # [N, 1, 1, src_len] bool, True for real source tokens
    step: int = 0


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """x: [N, len, d] -> [N, heads, len, head_dim]."""
    return x.view(x.shape[0], x.shape[1], n_heads, -1).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, len, head_dim] -> [N, len, d]."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


class CachedDecoder:
    """A fastformer.Transformer's weights run the usual PyTorch way: SDPA, a key/value cache grown per step."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.config = model.config

    def _self_qkv(self, attention_module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [N, len, d] -> q, k, v: [N, heads, len, head_dim] from one fused projection."""
        qkv = F.linear(x, attention_module.in_proj_weight, attention_module.in_proj_bias)
        return tuple(_heads(part, self.config.n_heads) for part in qkv.chunk(3, dim=-1))

    def _cross_kv(self, attention_module, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """memory: [N, src_len, d] -> keys, values: [N, heads, src_len, head_dim]."""
        d = self.config.d_model
        kv = F.linear(memory, attention_module.in_proj_weight[d:], attention_module.in_proj_bias[d:])
        keys, values = kv.chunk(2, dim=-1)
        return _heads(keys, self.config.n_heads), _heads(values, self.config.n_heads)

    def _cross_q(self, attention_module, x: torch.Tensor) -> torch.Tensor:
        d = self.config.d_model
        return _heads(F.linear(x, attention_module.in_proj_weight[:d], attention_module.in_proj_bias[:d]),
                      self.config.n_heads)

    @staticmethod
    def _attend(attention_module, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                keep: torch.Tensor | None) -> torch.Tensor:
        """q: [N, heads, q_len, head_dim], keys/values: [N, heads, k_len, head_dim] -> out_proj(SDPA): [N, q_len, d]."""
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep)
        return attention_module.out_proj(_merge_heads(out))

    def _embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens: [N, len] at positions start.. -> [N, len, d]."""
        model = self.model
        positions = model.positions[start:start + tokens.shape[1]]
        return model.embed_tokens(tokens) * math.sqrt(self.config.d_model) + positions

    @staticmethod
    def _norm(norm_module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, norm_module.normalized_shape, norm_module.weight, norm_module.bias, norm_module.eps)

    def encode(self, src_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src_tokens: [batch, src_len] -> (memory [batch, src_len, d], source_keep [batch, 1, 1, src_len])."""
        keep = (src_tokens != self.config.pad_id)[:, None, None, :]
        x = self._embed(src_tokens, 0)
        for layer in self.model.encoder.layers:
            def attend(h: torch.Tensor) -> torch.Tensor:
                return self._attend(layer.self_attn, *self._self_qkv(layer.self_attn, h), keep)

            if self.config.norm_first:
                x = x + attend(self._norm(layer.norm1, x))
                x = x + layer.ffn(self._norm(layer.norm2, x))
            else:
                x = self._norm(layer.norm1, x + attend(x))
                x = self._norm(layer.norm2, x + layer.ffn(x))
        if self.model.encoder.norm is not None:
            x = self._norm(self.model.encoder.norm, x)
        return x, keep

    def start(self, memory: torch.Tensor, source_keep: torch.Tensor, beam_size: int) -> DecoderState:
        """Each layer's cross-attention keys/values, computed once and copied for the beam_size rows of a sentence."""
        cross = [self._cross_kv(layer.multihead_attn, memory) for layer in self.model.decoder.layers]
        return DecoderState(
            self_keys=[None] * len(cross), self_values=[None] * len(cross),
            cross_keys=[k.repeat_interleave(beam_size, dim=0) for k, _ in cross],
            cross_values=[v.repeat_interleave(beam_size, dim=0) for _, v in cross],
            source_keep=source_keep.repeat_interleave(beam_size, dim=0),
        )

    def step(self, state: DecoderState, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [N], the previous output of each row -> logits [N, vocab] of the next token; grows the cache."""
        x = self._embed(tokens[:, None], state.step)
        for i, layer in enumerate(self.model.decoder.layers):
            def attend_self(h: torch.Tensor) -> torch.Tensor:
                q, keys, values = self._self_qkv(layer.self_attn, h)
                if state.self_keys[i] is not None:
                    keys = torch.cat([state.self_keys[i], keys], dim=2)
                    values = torch.cat([state.self_values[i], values], dim=2)
                state.self_keys[i], state.self_values[i] = keys, values
                # The cache holds only past positions, so the single query sees all of it: causal by construction.
                return self._attend(layer.self_attn, q, keys, values, None)

            def attend_source(h: torch.Tensor) -> torch.Tensor:
                q = self._cross_q(layer.multihead_attn, h)
                return self._attend(layer.multihead_attn, q, state.cross_keys[i], state.cross_values[i],
                                    state.source_keep)

            if self.config.norm_first:
                x = x + attend_self(self._norm(layer.norm1, x))
                x = x + attend_source(self._norm(layer.norm2, x))
                x = x + layer.ffn(self._norm(layer.norm3, x))
            else:
                x = self._norm(layer.norm1, x + attend_self(x))
                x = self._norm(layer.norm2, x + attend_source(x))
                x = self._norm(layer.norm3, x + layer.ffn(x))
        if self.model.decoder.norm is not None:
            x = self._norm(self.model.decoder.norm, x)
        state.step += 1
        return F.linear(x[:, 0], self.model.output_weight)

    @staticmethod
    def reorder(state: DecoderState, rows: torch.Tensor) -> None:
        """rows: [N] -> each row of the self-attention cache replaced by row rows[i] (the beam it continues)."""
        state.self_keys = [k.index_select(0, rows) for k in state.self_keys]
        state.self_values = [v.index_select(0, rows) for v in state.self_values]


@torch.no_grad()
def cached_beam_search(model: Transformer, src_tokens: torch.Tensor, beam_size: int = 4, length_penalty: float = 0.6,
                       max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 1,
                       n_best: int = 1) -> list[list[Hypothesis]]:
    """src_tokens: [batch, src_len] right-padded -> per sentence, up to n_best hypotheses, best first.

    The rules of fastformer.reference.beam_search, batched over sentences and beams with the usual cached decoder.
    """
    check_search_arguments(beam_size, length_penalty, max_len_a, max_len_b, min_len, n_best)
    config = model.config
    decoder = CachedDecoder(model)
    batch = src_tokens.shape[0]
    device = src_tokens.device
    memory, source_keep = decoder.encode(src_tokens)
    src_lengths = source_keep[:, 0, 0].sum(dim=1)
    max_lens = torch.tensor(max_target_lengths(src_lengths, max_len_a, max_len_b, config.max_positions),
                            device=device)
    state = decoder.start(memory, source_keep, beam_size)

    # Only the first beam of a sentence is alive at the start: the others begin at -inf and are never chosen.
    sums = torch.full((batch, beam_size), float("-inf"), device=device)
    sums[:, 0] = 0.0
    tokens = torch.full((batch * beam_size, 1), config.bos_id, dtype=torch.long, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    sentence_rows = torch.arange(batch, device=device)[:, None] * beam_size
    rank_order = torch.arange(2 * beam_size, device=device)
    for step in range(int(max_lens.max()) + 1):
        log_probs = F.log_softmax(decoder.step(state, tokens[:, -1]).float(), dim=-1)
        vocab = log_probs.shape[1]
        log_probs = log_probs.view(batch, beam_size, vocab)
        log_probs[:, :, [config.pad_id, config.bos_id]] = float("-inf")
        forced = (max_lens == step)[:, None, None]
        eos_only = torch.full_like(log_probs, float("-inf"))
        eos_only[:, :, config.eos_id] = log_probs[:, :, config.eos_id]
        log_probs = torch.where(forced, eos_only, log_probs)
        if step < min_len:
            log_probs[:, :, config.eos_id] = torch.where(forced[:, :, 0], log_probs[:, :, config.eos_id],
                                                         float("-inf"))
        candidate_sums, candidates = (sums[:, :, None] + log_probs).view(batch, -1).topk(2 * beam_size, dim=1)
        beams, words = candidates // vocab, candidates % vocab
        finite = torch.isfinite(candidate_sums)
        is_eos = (words == config.eos_id) & finite
        finishing = is_eos & (rank_order < beam_size) & ~done[:, None]
        # The first beam_size non-EOS finite candidates stay alive, in rank order.
        stays = ~is_eos & finite
        keep_rank = torch.where(stays, rank_order, rank_order + 2 * beam_size).topk(beam_size, largest=False).values
        kept = keep_rank % (2 * beam_size)
        kept_alive = stays.gather(1, kept)

        for sentence, rank in finishing.nonzero().tolist():
            beam = int(beams[sentence, rank])
            row = sentence * beam_size + beam
            score = float(candidate_sums[sentence, rank]) / length_penalty_divisor(step + 1, length_penalty)
            finished[sentence].append(Hypothesis(tokens[row, 1:].tolist(), score))
        done |= torch.tensor([len(hypotheses) >= beam_size for hypotheses in finished], device=device)
        done |= ~kept_alive.any(dim=1)
        if bool(done.all()):
            break
        sums = torch.where(kept_alive, candidate_sums.gather(1, kept), float("-inf"))
        rows = (sentence_rows + beams.gather(1, kept)).view(-1)
        tokens = torch.cat([tokens.index_select(0, rows), words.gather(1, kept).view(-1, 1)], dim=1)
        decoder.reorder(state, rows)
    return [sorted(hypotheses, key=lambda h: -h.score)[:n_best] for hypotheses in finished]


# ---------------------------------------------------------------------------------------------------------------------
# The engines people deploy: CTranslate2 (through fastformer.translation.export) and Hugging Face's
# MarianMTModel.generate


def placeholder_vocabulary(config: TransformerConfig) -> list[str]:
    """Distinct token strings for random-weight benchmarks, with the special pieces at the config's ids."""
    tokens = [f"t{i}" for i in range(config.vocab_size)]
    tokens[config.pad_id], tokens[config.eos_id] = "<pad>", "</s>"
    if config.bos_id != config.pad_id:
        tokens[config.bos_id] = "<s>"
    tokens[next(i for i in range(config.vocab_size) if i not in (config.pad_id, config.bos_id, config.eos_id))] = "<unk>"
    return tokens


@dataclass(frozen=True)
class Ctranslate2Mode:
    """A way to run CTranslate2: its threading ("intra": one batch on intra-op threads; "inter": its throughput
    mode, batches translated in parallel, inter_threads = threads, max_batch_size = ceil(sentences / threads)) and the
    instruction set its own kernels run at (isa: CT2_FORCE_CPU_ISA's value, or None for its own pick)."""
    threading: str
    isa: str | None = None

    @property
    def name(self) -> str:
        """"intra", "inter", "intra AVX512", ...: how rows and processes name it (threading, a space, isa)."""
        return " ".join(part for part in (self.threading, self.isa) if part)

    def environment(self, parent: Mapping[str, str], cap: str | None = None) -> dict[str, str]:
        """parent's variables as a process running CTranslate2 in this mode needs them before it loads CTranslate2:
        CT2_FORCE_CPU_ISA set to its isa, or for its own pick to `cap` (a run's deliberate cap) or unset, so that one
        exported in the shell does not run a row at an instruction set the row does not name."""
        environment = {name: value for name, value in parent.items() if name != "CT2_FORCE_CPU_ISA"}
        if self.isa or cap:
            environment["CT2_FORCE_CPU_ISA"] = self.isa or cap
        return environment

    def settings(self, threads: int, sentences: int) -> dict[str, int]:
        """CTranslate2's settings in this threading on `threads` threads for a batch of `sentences`: its Translator's
        intra_threads and inter_threads, and translate_batch's max_batch_size (0: the batch in one piece)."""
        inter = self.threading == "inter"
        return {"intra_threads": 1 if inter else threads, "inter_threads": threads if inter else 1,
                "max_batch_size": math.ceil(sentences / threads) if inter else 0}


def ctranslate2_modes(threads: int, isa_capped: bool) -> list[Ctranslate2Mode]:
    """The modes a benchmark times CTranslate2 in, so that its ratios are against CTranslate2 at its best: both
    threadings where threads > 1; and on an AVX-512 CPU, unless the run caps the instruction set, each also with
    CT2_FORCE_CPU_ISA=AVX512. CTranslate2 runs its own kernels (softmax, layer norm, the int8 quantization of
    activations; its GEMMs are oneDNN's or MKL's, which pick their own) at AVX2 unless that variable asks for AVX-512
    (its cpu_isa.cc: "AVX512 can only be enabled with the environment variable"); forced to AVX-512 on the Zen 4
    EPYC, its int8 search ran 4-12% faster and float32 alike (results/2026-11-30-cpu-amd-epyc-2core-d)."""
    threadings = ("intra", "inter") if threads > 1 else ("intra",)
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= cpu_name_and_flags()[1]
    isas = (None, "AVX512") if avx512 and not isa_capped else (None,)
    return [Ctranslate2Mode(threading, isa) for isa in isas for threading in threadings]


def ctranslate2_engine(model: Transformer, vocabulary: list[str], quantization: str,
                       files: dict[str, str] | None = None, **translator_options):
    """A ctranslate2.Translator on the model's weights exported with `quantization` (and `files`, name -> text,
    beside them, e.g. a vocabulary map): the export lives in a temporary directory removed once the engine has
    loaded it, so that a benchmark's processes do not leave a model (60-240 MB) each behind."""
    import ctranslate2

    from fastformer.translation.export import to_ctranslate2

    with tempfile.TemporaryDirectory(prefix="fastformer-ct2-") as directory:
        to_ctranslate2(model, vocabulary, Path(directory), quantization=quantization)
        for name, text in (files or {}).items():
            (Path(directory) / name).write_text(text, encoding="utf-8")
        return ctranslate2.Translator(directory, **translator_options)


def marian_model(model: Transformer):
    """fastformer's weights in a transformers MarianMTModel -> (the model, None), or (None, why not) for a config
    Marian cannot express."""
    config = model.config
    if config.norm_first:
        return None, "MarianMTModel is post-LN only"
    from transformers import MarianConfig, MarianMTModel

    marian_config = MarianConfig(
        vocab_size=config.vocab_size, d_model=config.d_model, encoder_layers=config.n_encoder_layers,
        decoder_layers=config.n_decoder_layers, encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads, encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff,
        activation_function={"relu": "relu", "gelu": "gelu", "swish": "silu"}[config.activation],
        max_position_embeddings=config.max_positions, scale_embedding=config.scale_embedding,
        pad_token_id=config.pad_id, eos_token_id=config.eos_id, decoder_start_token_id=config.bos_id,
        forced_eos_token_id=None, bad_words_ids=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        tie_word_embeddings=config.tie_embeddings, share_encoder_decoder_embeddings=True)
    marian = MarianMTModel(marian_config).eval()
    state = {}
    for side, layers in (("encoder", model.encoder.layers), ("decoder", model.decoder.layers)):
        state[f"model.{side}.embed_positions.weight"] = model.positions[:config.max_positions]
        for i, layer in enumerate(layers):
            prefix = f"model.{side}.layers.{i}."
            attentions = [("self_attn", layer.self_attn, layer.norm1)]
            if side == "decoder":
                attentions.append(("encoder_attn", layer.multihead_attn, layer.norm2))
            for name, attention, norm in attentions:
                for part, weight, bias in zip("qkv", attention.in_proj_weight.chunk(3), attention.in_proj_bias.chunk(3)):
                    state[f"{prefix}{name}.{part}_proj.weight"], state[f"{prefix}{name}.{part}_proj.bias"] = weight, bias
                state[f"{prefix}{name}.out_proj.weight"] = attention.out_proj.weight
                state[f"{prefix}{name}.out_proj.bias"] = attention.out_proj.bias
                state[f"{prefix}{name}_layer_norm.weight"], state[f"{prefix}{name}_layer_norm.bias"] = norm.weight, norm.bias
            last_norm = layer.norm3 if side == "decoder" else layer.norm2
            state[f"{prefix}fc1.weight"], state[f"{prefix}fc1.bias"] = layer.ffn.linear1.weight, layer.ffn.linear1.bias
            state[f"{prefix}fc2.weight"], state[f"{prefix}fc2.bias"] = layer.ffn.linear2.weight, layer.ffn.linear2.bias
            state[f"{prefix}final_layer_norm.weight"], state[f"{prefix}final_layer_norm.bias"] = (last_norm.weight,
                                                                                              last_norm.bias)
    state["model.shared.weight"] = model.embed_tokens.weight
    state["lm_head.weight"] = model.output_weight
    state["final_logits_bias"] = (model.output_bias if model.output_bias is not None
                                  else model.output_weight.new_zeros(config.vocab_size))[None]
    own = marian.state_dict()
    missing = {name for name in own if name not in state and not name.endswith("embed_tokens.weight")}
    if missing:
        return None, f"no fastformer weight for {sorted(missing)[:3]}"
    with torch.no_grad():
        for name, value in state.items():
            own[name].copy_(value.detach().to(own[name].dtype))
        for side in ("encoder", "decoder"):
            own[f"model.{side}.embed_tokens.weight"].copy_(model.embed_tokens.weight)
    return marian, None
