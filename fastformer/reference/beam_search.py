"""Beam search that recomputes the decoder over the whole prefix at every step: the oracle of the compiled decoder.

The scoring rules (fairseq's candidate rule) that every beam search in fastformer follows exactly:
- score(Y) = sum of the log-probabilities of Y's tokens including the final EOS, divided by a length penalty of |Y|,
  the number of Y's real tokens plus its EOS (BOS is not counted); log-probabilities are the fp32 log-softmax over
  the whole vocabulary. With alpha = length_penalty, length_penalty_form chooses the penalty:
  - "gnmt" (the default; Wu et al. 2016): ((5 + |Y|) / 6) ** alpha.
  - "length": |Y| ** alpha, the form of fairseq, transformers, CTranslate2 and Marian. |Y| is counted as
    transformers' `generate` counts it for encoder-decoder models: the tokens generated after the decoder's start
    token, EOS included (a hypothesis that takes EOS at sequence length cur_len is divided by
    (cur_len + 1 - decoder_prompt_len) ** length_penalty, decoder_prompt_len being 1, the start token).
    CTranslate2 divides by the length of the hypothesis it returns, which for translation leaves EOS out: its |Y|
    is one less (the real tokens alone), except for a hypothesis cut at max_length, which has no EOS.
- PAD and BOS are never emitted. EOS is barred while a hypothesis has fewer than `min_len` real tokens, and forced
  once it has max_len = min(floor(max_len_a * src_len + max_len_b), max_positions - 1) of them (src_len counts the
  source's real tokens, its EOS included); forcing wins over barring.
- Each step ranks, per sentence, every candidate (alive hypothesis, next token) by its running sum of
  log-probabilities, best first, ties to the lower (beam, token) index, and keeps the first 2 * beam_size finite
  ones. EOS candidates among the first beam_size finish a hypothesis (all of them: a sentence can hold up to
  2 * beam_size - 1 finished ones); the first beam_size non-EOS candidates stay alive.
- A sentence is done once beam_size hypotheses have finished or none is alive. Its hypotheses are returned best
  score first (ties in the order they finished), at most n_best of them.
- With return_attention, a hypothesis's attention has a row per output token (EOS last): the last decoder layer's
  cross-attention probabilities averaged over heads at the step that chose the token, over the source's real
  tokens (its EOS included).
- Options acting on a hypothesis's tokens so far (its generated tokens, a target prefix's included, BOS not), as
  CTranslate2 defines them, on the logits before the log-softmax: repetition_penalty divides the logit of every token
  the hypothesis holds where it is positive and multiplies it where negative; no_repeat_ngram_size = n gives -inf to
  every token that would complete an n-gram the hypothesis holds already. They act after a target prefix only.
- target_prefix: at step t < len(prefix) a hypothesis may take only prefix[t], scored by its log-probability (as
  CTranslate2, which forces a prefix whatever the other options say); the prefix is part of the returned tokens and
  counts towards min_len and max_len.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from fastformer.decoding.rules import (Hypothesis, check_history_arguments, check_search_arguments, check_target_prefix,
                                      eval_mode, length_penalty_divisor, max_target_lengths)
from fastformer.reference.attention import attention_weights


def beam_search(model, src_tokens: torch.Tensor, beam_size: int = 4, length_penalty: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 1, n_best: int = 1,
                length_penalty_form: str = "gnmt", target_prefix: list[list[int] | None] | None = None,
                no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0,
                return_attention: bool = False) -> list[list[Hypothesis]]:
    """src_tokens: [batch, src_len] right-padded -> per sentence, up to n_best hypotheses, best first (each with its
    attention [len(tokens) + 1, src_length] float32 on the CPU where return_attention).

    `model` is a fastformer.Transformer, searched in eval mode as translate searches it; each sentence is searched on
    its own with `model.decode` over the whole prefix at every step (no cache), which is slow and obviously faithful
    to the rules above.
    """
    check_search_arguments(beam_size, length_penalty, max_len_a, max_len_b, min_len, n_best, length_penalty_form)
    check_history_arguments(no_repeat_ngram_size, repetition_penalty)
    config = model.config
    with torch.no_grad(), eval_mode(model):
        encoder_out = model.encode(src_tokens)
        max_lens = max_target_lengths(encoder_out.src_lengths, max_len_a, max_len_b, config.max_positions)
        if target_prefix is not None:
            target_prefix = check_target_prefix(target_prefix, max_lens, config.vocab_size,
                                                (config.pad_id, config.bos_id, config.eos_id))
        history_rules = _HistoryRules(no_repeat_ngram_size, repetition_penalty)
        return [_search_sentence(model, encoder_out, i, beam_size, length_penalty, length_penalty_form, max_lens[i],
                                 min_len, (target_prefix[i] if target_prefix else None) or [], history_rules,
                                 return_attention)[:n_best]
                for i in range(src_tokens.shape[0])]


@contextmanager
def last_cross_attention(model) -> Iterator[list[torch.Tensor]]:
    """Within the block, each call of `model`'s decoder appends to the yielded list its last layer's cross-attention
    probabilities averaged over heads, [batch, tgt_len, src_len] float32, recomputed from that layer's inputs."""
    found: list[torch.Tensor] = []

    def record(module, args, kwargs, output) -> None:
        e, heads = module.embed_dim, module.num_heads

        def project(x: torch.Tensor, part: slice) -> torch.Tensor:  # -> [batch, len, heads, head_dim]
            bias = module.in_proj_bias[part] if module.in_proj_bias is not None else None
            return F.linear(x, module.in_proj_weight[part], bias).unflatten(-1, (heads, e // heads))

        q, k = project(args[0], slice(0, e)), project(args[1], slice(e, 2 * e))
        found.append(attention_weights(q, k, k_lengths=kwargs["key_lengths"]).mean(dim=1).float())

    handle = model.decoder.layers[-1].multihead_attn.register_forward_hook(record, with_kwargs=True)
    try:
        yield found
    finally:
        handle.remove()


class _HistoryRules:
    """no_repeat_ngram_size and repetition_penalty (the module docstring) on one hypothesis's logits."""

    def __init__(self, no_repeat_ngram_size: int, repetition_penalty: float) -> None:
        self.n, self.penalty = no_repeat_ngram_size, repetition_penalty

    def apply(self, logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """logits: [vocab] of the hypothesis `tokens` -> the logits it is ranked by."""
        logits = logits.clone()
        if self.penalty != 1.0:
            for token in set(tokens):
                value = logits[token]
                logits[token] = value / self.penalty if value > 0 else value * self.penalty
        n = self.n
        if n > 0:
            tail = tokens[len(tokens) - n + 1:] if n > 1 else []
            for i in range(len(tokens) - n + 1):
                if tokens[i:i + n - 1] == tail:
                    logits[tokens[i + n - 1]] = float("-inf")
        return logits


def _search_sentence(model, encoder_out, sentence: int, beam_size: int, length_penalty: float,
                     length_penalty_form: str, max_len: int, min_len: int, prefix: list[int],
                     history_rules: _HistoryRules, return_attention: bool = False) -> list[Hypothesis]:
    """encoder_out: the whole batch's EncoderOutput; searches one sentence -> its finished hypotheses, best first."""
    config = model.config
    memory, src_lengths = encoder_out
    device = memory.device
    src_length = int(src_lengths[sentence])
    alive: list[list[int]] = [[]]
    alive_attention: list[list[torch.Tensor]] = [[]]  # per alive hypothesis, the attention row of each token
    alive_sums = torch.zeros(1, dtype=torch.float32, device=device)
    finished: list[Hypothesis] = []
    for step in range(max_len + 1):
        n_alive = len(alive)
        prefixes = torch.tensor([[config.bos_id] + tokens for tokens in alive], device=device)
        # The sentence's memory row of the padded batch, so that the compiled decoder sees the very same numbers.
        beams_out = encoder_out._replace(memory=memory[sentence:sentence + 1].expand(n_alive, -1, -1),
                                         src_lengths=src_lengths[sentence:sentence + 1].expand(n_alive))
        with last_cross_attention(model) if return_attention else nullcontext([]) as found:
            logits = model.decode(prefixes, beams_out)[:, -1].float()
        # [n_alive, src_length]: each alive hypothesis's row for the token this step chooses.
        step_attention = found[0][:, -1, :src_length].cpu() if return_attention else None
        if step >= len(prefix):
            logits = torch.stack([history_rules.apply(row, tokens) for row, tokens in zip(logits, alive)])
        log_probs = F.log_softmax(logits, dim=-1)
        log_probs[:, [config.pad_id, config.bos_id]] = float("-inf")
        if step < len(prefix):  # step < max_len: a prefix is at most max_len long
            forced_column = log_probs[:, prefix[step]].clone()
            log_probs.fill_(float("-inf"))
            log_probs[:, prefix[step]] = forced_column
        if step == max_len:
            eos_column = log_probs[:, config.eos_id].clone()
            log_probs.fill_(float("-inf"))
            log_probs[:, config.eos_id] = eos_column
        elif step < min_len:
            log_probs[:, config.eos_id] = float("-inf")
        candidates = (alive_sums[:, None] + log_probs).flatten()
        ranked_sums, ranked = torch.sort(candidates, descending=True, stable=True)
        next_alive, next_sums, next_attention = [], [], []
        vocab = log_probs.shape[1]
        for rank, (running_sum, index) in enumerate(zip(ranked_sums[:2 * beam_size].tolist(),
                                                       ranked[:2 * beam_size].tolist())):
            if running_sum == float("-inf"):
                break
            beam, token = divmod(index, vocab)
            rows = alive_attention[beam] + [step_attention[beam]] if return_attention else []
            if token == config.eos_id:
                if rank < beam_size:
                    divisor = length_penalty_divisor(step + 1, length_penalty, length_penalty_form)
                    attention = torch.stack(rows) if return_attention else None
                    finished.append(Hypothesis(alive[beam], running_sum / divisor, attention))
            elif len(next_alive) < beam_size:
                next_alive.append(alive[beam] + [token])
                next_sums.append(running_sum)
                next_attention.append(rows)
        if len(finished) >= beam_size or not next_alive:
            break
        alive, alive_attention = next_alive, next_attention
        alive_sums = torch.tensor(next_sums, dtype=torch.float32, device=memory.device)
    return sorted(finished, key=lambda hypothesis: -hypothesis.score)

