"""Alignments: `translate(..., return_attention=True)` (the compiled search) against the reference search and against
teacher forcing, and `hard_alignment` against a brute-force argmax."""

import pytest
import torch

import fastformer
from fastformer import Transformer
from fastformer.decoding.alignment import hard_alignment
from fastformer.decoding.compiled import extension
from fastformer.reference.beam_search import Hypothesis, beam_search, last_cross_attention
from test_beam_search import (MARIAN, SHRINKS, assert_same_hypotheses, batch_invariance_atol, make_model,
                              padded_sources)

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [7, 2, 5, 1, 4, 9]  # a padded batch whose sentences finish at different steps
SEARCH = dict(max_len_a=1.0, max_len_b=4, min_len=1, length_penalty=0.6)


def peaked_model(norm_first: bool = False, **overrides) -> Transformer:
    """make_model with its last layer's cross-attention queries scaled up: sharp attention whose rows differ from
    prefix to prefix, so that a row taken from the wrong beam or step cannot pass for the right one."""
    model = make_model(norm_first, eos_scale=8.0, **overrides)
    attention = model.decoder.layers[-1].multihead_attn
    with torch.no_grad():
        attention.in_proj_weight[:attention.embed_dim].mul_(4.0)
    return model


def assert_same_attention(got: list[list[Hypothesis]], expected: list[list[Hypothesis]], atol: float = 2e-6) -> None:
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
    for sentence, (got_hyps, expected_hyps) in enumerate(zip(got, expected)):
        for rank, (g, e) in enumerate(zip(got_hyps, expected_hyps)):
            assert g.attention.dtype == torch.float32 and g.attention.device.type == "cpu"
            assert g.attention.shape == e.attention.shape, f"sentence {sentence}, hypothesis {rank}"
            torch.testing.assert_close(g.attention, e.attention, atol=atol, rtol=0,
                                       msg=lambda m: f"sentence {sentence}, hypothesis {rank}: {m}")


def teacher_forced_attention(model: Transformer, src: torch.Tensor, sentence: int, tokens: list[int]) -> torch.Tensor:
    """The reference decoder's last-layer cross-attention over [BOS, *tokens] for the batch's sentence, cut to its
    source: [len(tokens) + 1, src_length], row p the one that predicts the token after position p."""
    encoder_out = model.encode(src)
    one = encoder_out._replace(memory=encoder_out.memory[sentence:sentence + 1],
                               src_lengths=encoder_out.src_lengths[sentence:sentence + 1])
    with torch.no_grad(), last_cross_attention(model) as found:
        model.decode(torch.tensor([[model.config.bos_id, *tokens]]), one)
    return found[0][0, :, :int(encoder_out.src_lengths[sentence])]


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("beam_size,n_best", [(1, 1), (4, 1), (4, 4), (3, 2)])
@pytest.mark.parametrize("norm_first,options", [(False, {}), (True, dict(activation="gelu")), (False, MARIAN)],
                         ids=["post-ln", "pre-ln", "marian"])
def test_attention_matches_the_reference_search(norm_first, options, beam_size, n_best, shrink):
    model = peaked_model(norm_first, **options)
    src = padded_sources(model, LENGTHS, seed=beam_size)
    search = dict(beam_size=beam_size, n_best=n_best, **SEARCH)
    got = model.translate(src, shrink=shrink, return_attention=True, **search)
    expected = beam_search(model, src, return_attention=True, **search)
    assert_same_hypotheses(got, expected, atol=1e-4)  # the sharpened queries amplify float noise in the scores
    assert_same_attention(got, expected)


@pytest.mark.parametrize("shrink", SHRINKS)
def test_greedy_search_without_scores_returns_the_attention_of_the_scored_search(shrink):
    """beam 1 with return_scores=False takes the CPU's greedy step (no log-softmax), which must fill it too."""
    model = peaked_model()
    src = padded_sources(model, LENGTHS, seed=2)
    got = model.translate(src, beam_size=1, return_scores=False, return_attention=True, shrink=shrink, **SEARCH)
    assert all(h.score is None for hyps in got for h in hyps)
    assert_same_attention(got, beam_search(model, src, beam_size=1, return_attention=True, **SEARCH))


def test_each_row_is_the_teacher_forced_attention_of_its_own_prefix():
    """Row p of a hypothesis is the attention of the step that chose its token p: the one of the beam that was its
    parent then, not of the slot it went to. Teacher forcing each returned hypothesis knows nothing of beams; the
    rows of different hypotheses differ far more than the tolerance, so a row from a sibling beam would show."""
    model = peaked_model()
    src = padded_sources(model, LENGTHS, seed=7)
    got = model.translate(src, beam_size=4, n_best=4, return_attention=True, **SEARCH)
    spread = 0.0
    for sentence, hyps in enumerate(got):
        for h in hyps:
            expected = teacher_forced_attention(model, src, sentence, h.tokens)
            torch.testing.assert_close(h.attention, expected, atol=2e-6, rtol=0)
        for a, b in zip(hyps, hyps[1:]):
            rows = min(len(a.attention), len(b.attention))
            spread = max(spread, (a.attention[:rows] - b.attention[:rows]).abs().max().item())
    assert spread > 0.1


@pytest.mark.parametrize("compute_type", ["float32", "bfloat16", "int8"])
def test_rows_are_distributions_over_the_real_source_and_change_nothing_else(compute_type):
    model = peaked_model()
    src = padded_sources(model, LENGTHS, seed=3)
    search = dict(beam_size=4, n_best=3, compute_type=compute_type, **SEARCH)
    plain = model.translate(src, **search)
    got = model.translate(src, return_attention=True, **search)
    assert [[(h.tokens, h.score) for h in hyps] for hyps in got] == [[h[:2] for h in hyps] for hyps in plain]
    assert all(h.attention is None for hyps in plain for h in hyps)
    for length, hyps in zip(LENGTHS, got):
        for h in hyps:
            assert h.attention.shape == (len(h.tokens) + 1, length) and h.attention.dtype == torch.float32
            assert (h.attention >= 0).all()
            torch.testing.assert_close(h.attention.sum(dim=1), torch.ones(len(h.tokens) + 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("compute_type", ["float32", "int8"])
@pytest.mark.parametrize("shrink", SHRINKS)
def test_attention_does_not_depend_on_the_batch(compute_type, shrink):
    model = peaked_model()
    src = padded_sources(model, LENGTHS, seed=4)
    search = dict(beam_size=4, n_best=2, compute_type=compute_type, shrink=shrink, return_attention=True, **SEARCH)
    batch = model.translate(src, **search)
    alone = [model.translate(src[i:i + 1, :length], **search)[0] for i, length in enumerate(LENGTHS)]
    assert_same_hypotheses(batch, alone, atol=batch_invariance_atol(model, compute_type))
    assert_same_attention(batch, alone, atol=1e-6)


def test_int8_attention_is_the_attention_of_its_own_hypotheses():
    """int8 changes the linear layers only: its rows stay close to the float32 model's teacher-forced attention of
    the hypotheses it found."""
    model = peaked_model()
    src = padded_sources(model, LENGTHS, seed=5)
    got = model.translate(src, beam_size=4, n_best=2, compute_type="int8", return_attention=True, **SEARCH)
    for sentence, hyps in enumerate(got):
        for h in hyps:
            torch.testing.assert_close(h.attention, teacher_forced_attention(model, src, sentence, h.tokens),
                                       atol=0.05, rtol=0)


def test_sentence_groups_on_several_threads_return_the_same_attention():
    model = peaked_model(vocab=37)
    lengths = [7, 2, 5, 1, 4, 9, 3, 8, 6, 2, 5, 7, 1, 4] * 5
    src = padded_sources(model, lengths, seed=3)
    search = dict(beam_size=3, n_best=3, return_attention=True, **SEARCH)
    assert extension().cpu_sentence_groups(len(src), 3 * len(src), "float32", 3) == 3
    one_thread = model.translate(src, **search)
    torch.set_num_threads(3)
    try:
        grouped = model.translate(src, **search)
    finally:
        torch.set_num_threads(1)
    assert_same_attention(grouped, one_thread, atol=0.0)


def test_a_hypothesis_ended_at_the_first_step_has_the_eos_row_alone():
    model = peaked_model()
    src = padded_sources(model, [3, 5, 2], seed=6)
    search = dict(beam_size=2, n_best=2, max_len_a=0.0, max_len_b=0, return_attention=True)
    got = model.translate(src, shrink="buckets", **search)
    assert all(h.tokens == [] and h.attention.shape == (1, length) for length, hyps in zip([3, 5, 2], got)
               for h in hyps)
    assert_same_attention(got, beam_search(model, src, **search))


def test_return_attention_must_be_a_bool():
    model = make_model()
    with pytest.raises(TypeError, match="return_attention must be a bool, got 'yes'"):
        model.translate(padded_sources(model, [3]), return_attention="yes")


def test_a_hypothesis_without_attention_keeps_the_two_field_form():
    assert Hypothesis([3, 4], -1.5) == ([3, 4], -1.5, None)


def brute_force_alignment(attention: torch.Tensor, src_count: int, tgt_count: int) -> list[tuple[int, int]]:
    pairs = []
    for j in range(tgt_count):
        row = attention[j].tolist()
        best = 0
        for i in range(1, src_count):
            if row[i] > row[best]:
                best = i
        pairs.append((best, j))
    return pairs


@pytest.mark.parametrize("seed", range(5))
def test_hard_alignment_is_the_argmax_over_real_source_tokens_of_each_real_target_token(seed):
    generator = torch.Generator().manual_seed(seed)
    tgt_count, src_count = [int(n) for n in torch.randint(1, 9, (2,), generator=generator)]
    # One row per target token and EOS, one column per source token and EOS; rounded so that ties occur.
    attention = torch.softmax(torch.randn(tgt_count + 1, src_count + 1, generator=generator), dim=1)
    attention = (attention * 4).round() / 4
    assert hard_alignment(attention, src_count, tgt_count) == brute_force_alignment(attention, src_count, tgt_count)


def test_hard_alignment_of_a_translation_skips_both_eos():
    model = peaked_model()
    src = padded_sources(model, [6], seed=8)
    (h,) = model.translate(src, beam_size=4, return_attention=True, **SEARCH)[0]
    pairs = hard_alignment(h.attention, src_tokens_count=5, tgt_tokens_count=len(h.tokens))
    assert pairs == brute_force_alignment(h.attention, 5, len(h.tokens))
    assert [j for _, j in pairs] == list(range(len(h.tokens))) and all(0 <= i < 5 for i, _ in pairs)


def test_hard_alignment_of_a_source_of_eos_alone_is_empty():
    assert hard_alignment(torch.ones(3, 1), 0, 2) == []


@pytest.mark.parametrize("args,error", [
    ((torch.ones(3), 1, 1), r"attention must be a 2-D tensor \[target tokens, source tokens\], got \(3,\)"),
    ((torch.ones(3, 2), 3, 1), r"src_tokens_count must be in \[0, 2\] \(the attention's columns\), got 3"),
    ((torch.ones(3, 2), 1, -1), r"tgt_tokens_count must be in \[0, 3\] \(the attention's rows\), got -1"),
])
def test_hard_alignment_rejects_bad_arguments(args, error):
    with pytest.raises(ValueError, match=error):
        hard_alignment(*args)


# GPU: the same attention from the CUDA search, its bucketed steps replayed as CUDA graphs. The reference runs under
# the "reference" backend (plain PyTorch fp32).

@pytest.mark.gpu
@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("beam_size,n_best", [(1, 1), (4, 4)])
def test_cuda_attention_matches_the_reference_search(beam_size, n_best, shrink):
    model = peaked_model().cuda()
    src = padded_sources(model, LENGTHS, seed=beam_size).cuda()
    search = dict(beam_size=beam_size, n_best=n_best, return_attention=True, **SEARCH)
    with fastformer.backend("reference"):
        got = model.translate(src, shrink=shrink, **search)
        expected = beam_search(model, src, **search)
    assert_same_hypotheses(got, expected, atol=1e-4)
    assert_same_attention(got, expected, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("shrink", SHRINKS)
def test_cuda_float16_attention_rows_are_distributions_over_the_real_source(shrink):
    model = peaked_model().cuda()
    src = padded_sources(model, LENGTHS, seed=3).cuda()
    got = model.translate(src, beam_size=4, n_best=2, compute_type="float16", shrink=shrink, return_attention=True,
                          **SEARCH)
    for length, hyps in zip(LENGTHS, got):
        for h in hyps:
            assert h.attention.shape == (len(h.tokens) + 1, length) and h.attention.device.type == "cpu"
            torch.testing.assert_close(h.attention.sum(dim=1), torch.ones(len(h.tokens) + 1), atol=1e-5, rtol=0)
