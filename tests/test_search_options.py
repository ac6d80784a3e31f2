"""The compiled search's CTranslate2 options: target prefix, no_repeat_ngram_size and repetition_penalty against the
reference search and brute force (and CTranslate2 where installed); sampling against the model's own softmax; batch
invariance of every option; the errors of bad options."""

import itertools
import math

import numpy
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import Transformer
from fastformer.data import EOS_ID
from fastformer.decoding.compiled import extension
from fastformer.reference.beam_search import beam_search
from marian_models import CALIBRATION
from test_beam_search import (assert_same_hypotheses, batch_invariance_atol, make_model, padded_sources,
                              real_token_ids)
from test_translator import tiny_checkpoint  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [7, 4, 9, 2, 12, 5]
# Options of the reference search that the compiled one must follow (prefixes: one per sentence of LENGTHS).
PREFIXES = [[5, 6], None, [7], [8, 9, 10], [], [11, 11, 11]]
OPTIONS = {
    "prefix": dict(target_prefix=PREFIXES),
    "ngram-1": dict(no_repeat_ngram_size=1),
    "ngram-2": dict(no_repeat_ngram_size=2),
    "ngram-3": dict(no_repeat_ngram_size=3),
    "penalty-1.5": dict(repetition_penalty=1.5),
    "penalty-0.7": dict(repetition_penalty=0.7),
    "all": dict(target_prefix=PREFIXES, no_repeat_ngram_size=2, repetition_penalty=1.3),
}


@pytest.mark.parametrize("shrink", ["every_step", "buckets"])
@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("name", OPTIONS)
def test_options_match_the_reference_search(name, beam_size, shrink):
    model = make_model(eos_scale=1.5)
    src = padded_sources(model, LENGTHS)
    search = dict(beam_size=beam_size, n_best=beam_size, max_len_a=0.5, max_len_b=5, min_len=1, **OPTIONS[name])
    expected = beam_search(model, src, **search)
    assert_same_hypotheses(model.translate(src, shrink=shrink, **search), expected)
    for sentence, prefix in enumerate(search.get("target_prefix") or []):
        assert all(h.tokens[:len(prefix or [])] == (prefix or []) for h in expected[sentence])


def brute_force_best(model: Transformer, src: torch.Tensor, max_len: int, prefix: list[int], ngram: int,
                     penalty: float) -> tuple[list[int], float]:
    """src: [1, src_len] -> the target (starting with prefix, at most max_len real tokens) of the highest sum of
    log-probabilities (length penalty 0), each position's logits changed by the tokens before it: every repeated
    token's logit divided (positive) or multiplied (negative) by the penalty, every token that would repeat an
    n-gram barred (after the prefix only)."""
    config = model.config
    encoder_out = model.encode(src)
    best_tokens, best = None, -math.inf
    for length in range(len(prefix), max_len + 1):
        for rest in itertools.product(real_token_ids(config), repeat=length - len(prefix)):
            tokens = prefix + list(rest)
            logits = model.decode(torch.tensor([[config.bos_id, *tokens]]), encoder_out)[0].float()
            total = 0.0
            for position, target in enumerate(tokens + [config.eos_id]):
                row, before = logits[position].clone(), tokens[:position]
                if position < len(prefix):
                    total += F.log_softmax(row, dim=-1)[target].item()
                    continue
                for token in set(before):
                    row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
                seen = {tuple(before[i:i + ngram]) for i in range(len(before) - ngram + 1)} if ngram else set()
                for token in range(config.vocab_size):
                    if tuple(before[len(before) - ngram + 1:] + [token]) in seen:
                        row[token] = -math.inf
                total += F.log_softmax(row, dim=-1)[target].item()
            if total > best:
                best_tokens, best = tokens, total
    return best_tokens, best


@pytest.mark.parametrize("prefix,ngram,penalty", [([4], 0, 1.0), ([], 1, 1.0), ([], 2, 1.0), ([], 0, 2.0),
                                                  ([], 0, 0.5), ([5, 5], 2, 1.5)])
def test_options_find_the_brute_force_optimum(prefix, ngram, penalty):
    """3 real tokens and at most 3 of them: a beam of 40 is exhaustive, so the compiled search, the reference and
    brute force must agree on the best hypothesis (prefix and n-grams bar some targets altogether)."""
    model = make_model(vocab=6, norm_first=True)
    src = padded_sources(model, [3])
    tokens, score = brute_force_best(model, src, 3, prefix, ngram, penalty)
    search = dict(beam_size=40, length_penalty=0.0, max_len_a=0.0, max_len_b=3, min_len=0,
                  target_prefix=[prefix], no_repeat_ngram_size=ngram, repetition_penalty=penalty)
    for got in (model.translate(src, **search), beam_search(model, src, **search)):
        assert got[0][0].tokens == tokens
        assert got[0][0].score == pytest.approx(score, abs=1e-5)


SAMPLING = dict(beam_size=1, sampling_topk=5, sampling_topp=0.9, sampling_temperature=0.8, seed=3)
INVARIANCE_OPTIONS = [*OPTIONS.values(), SAMPLING, dict(SAMPLING, target_prefix=PREFIXES, no_repeat_ngram_size=2),
                      dict(SAMPLING, sampling_topk=0, n_best=3)]


@pytest.mark.parametrize("compute_type", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("shrink", ["every_step", "buckets"])
@pytest.mark.parametrize("options", INVARIANCE_OPTIONS)
def test_every_option_translates_a_sentence_the_same_alone_and_in_a_batch(options, shrink, compute_type):
    model = make_model(eos_scale=1.5)
    src = padded_sources(model, LENGTHS)
    search = dict(dict(beam_size=4, max_len_a=0.5, max_len_b=5), shrink=shrink, compute_type=compute_type, **options)
    batch = model.translate(src, **search)
    atol = batch_invariance_atol(model, compute_type)
    for i, length in enumerate(LENGTHS):
        alone_search = dict(search)
        if "target_prefix" in search:
            alone_search["target_prefix"] = [search["target_prefix"][i]]
        alone = model.translate(src[i:i + 1, :length], **alone_search)
        assert_same_hypotheses(alone, [batch[i]], atol=atol)


# A vocabulary wide enough that the CPU search makes and ranks a step's logits in blocks (logits_rows_per_block: 30
# rows, 7 sentences of beam 4), so that BLOCKED_LENGTHS' 20 sentences are three blocks and a sentence alone is one.
BLOCKED_VOCAB = 1 << 18
BLOCKED_LENGTHS = [7, 4, 9, 2, 12, 5, 3, 8, 6, 10, 2, 7, 11, 4, 5, 9, 3, 6, 8, 2]


@pytest.mark.parametrize("options", [{}, OPTIONS["all"], dict(SAMPLING, target_prefix=PREFIXES),
                                     dict(return_attention=True)], ids=["plain", "all", "sampling", "attention"])
def test_a_step_ranked_in_blocks_translates_each_sentence_as_alone(options):
    assert 2 * extension().logits_rows_per_block(BLOCKED_VOCAB) // 4 < len(BLOCKED_LENGTHS)
    model = make_model(vocab=BLOCKED_VOCAB, eos_scale=1.5)
    src = padded_sources(model, BLOCKED_LENGTHS)
    prefixes = options.get("target_prefix")
    search = dict(dict(beam_size=4, n_best=4, max_len_a=0.5, max_len_b=5), compute_type="int8", **options)
    if prefixes:
        search["target_prefix"] = [prefixes[i % len(prefixes)] for i in range(len(BLOCKED_LENGTHS))]
    batch = model.translate(src, **search)
    for i, length in enumerate(BLOCKED_LENGTHS):
        alone_search = dict(search, target_prefix=[search["target_prefix"][i]]) if prefixes else search
        alone = model.translate(src[i:i + 1, :length], **alone_search)
        assert [h.tokens for h in alone[0]] == [h.tokens for h in batch[i]], f"sentence {i}"
        assert [h.score for h in alone[0]] == [h.score for h in batch[i]], f"sentence {i}"
        if options.get("return_attention"):
            for a, b in zip(alone[0], batch[i]):
                torch.testing.assert_close(a.attention, b.attention, atol=1e-6, rtol=0)


@pytest.mark.parametrize("options", [*OPTIONS.values(), SAMPLING, dict(SAMPLING, no_repeat_ngram_size=1)])
def test_every_option_takes_the_same_tokens_without_scores(options):
    """return_scores=False: greedy search and sampling on the CPU take the unscored path where it can run."""
    model = make_model(eos_scale=1.5)
    src = padded_sources(model, LENGTHS)
    search = dict(dict(beam_size=1, max_len_a=0.5, max_len_b=5), **options)
    scored = model.translate(src, **search)
    assert [[h.tokens for h in s] for s in model.translate(src, return_scores=False, **search)] == \
        [[h.tokens for h in s] for s in scored]


def first_step_probabilities(model: Transformer, src: torch.Tensor, topk: int, topp: float,
                             temperature: float) -> torch.Tensor:
    """[vocab]: the distribution sampling draws its first token from, from the model's own first-step logits: over
    the temperature, PAD/BOS/EOS (min_len 1) barred, the topk most likely, then the smallest set reaching topp."""
    config = model.config
    with torch.no_grad():
        logits = model.decode(torch.tensor([[config.bos_id]]), model.encode(src))[0, -1].double() / temperature
    logits[[config.pad_id, config.bos_id, config.eos_id]] = -math.inf
    order = torch.argsort(logits, descending=True)
    keep = order[:topk] if topk else order
    probs = torch.zeros_like(logits)
    probs[keep] = torch.softmax(logits[keep], dim=0)
    sorted_probs = probs[keep]
    kept = keep[(torch.cumsum(sorted_probs, 0) - sorted_probs) < topp]
    out = torch.zeros_like(logits)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


@pytest.mark.parametrize("topk,topp,temperature", [(0, 1.0, 1.0), (5, 1.0, 1.0), (0, 0.7, 1.0), (8, 0.8, 0.6),
                                                   (0, 1.0, 2.0)])
def test_sampled_first_tokens_follow_the_models_softmax(topk, topp, temperature):
    """4000 samples of one sentence (n_best: one batch of the sentence repeated): no token outside the kept set, and
    the counts pass a chi-square test against the expected probabilities (a fixed seed: it cannot flake)."""
    model = make_model(vocab=16)
    src = padded_sources(model, [5])
    n = 4000
    expected = first_step_probabilities(model, src, topk, topp, temperature)
    samples = model.translate(src, beam_size=1, n_best=n, max_len_a=0.0, max_len_b=1, sampling_topk=topk,
                              sampling_topp=topp, sampling_temperature=temperature, seed=11)[0]
    counts = torch.bincount(torch.tensor([h.tokens[0] for h in samples]), minlength=model.config.vocab_size).double()
    assert counts[expected == 0].sum() == 0
    kept = expected > 0
    chi_square = ((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])).sum().item()
    dof = int(kept.sum()) - 1
    assert chi_square < dof + 5 * math.sqrt(2 * max(dof, 1)) + 5
    assert 0.5 * (counts / n - expected).abs().sum() < 0.05


def test_sampling_depends_on_the_seed_and_the_sentence_only():
    model = make_model(eos_scale=1.5)
    src = padded_sources(model, LENGTHS)
    search = dict(beam_size=1, n_best=4, max_len_a=0.5, max_len_b=5, sampling_topk=0, return_scores=False)
    first = model.translate(src, seed=5, **search)
    assert model.translate(src, seed=5, **search) == first
    assert model.translate(src.flip(0), seed=5, **search) == first[::-1]
    other_seed = model.translate(src, seed=6, **search)
    assert other_seed != first
    assert all(len({tuple(h.tokens) for h in sentence}) > 1 for sentence in first[:3])  # the samples differ


def test_sampling_top_one_is_greedy_search():
    model = make_model(eos_scale=1.5)
    src = padded_sources(model, LENGTHS)
    greedy = model.translate(src, beam_size=1, max_len_a=0.5, max_len_b=5)
    assert model.translate(src, beam_size=1, max_len_a=0.5, max_len_b=5, sampling_topk=1,
                           sampling_temperature=0.3, seed=9) == greedy


def test_a_prefix_and_the_samples_after_it():
    model = make_model(eos_scale=1.5)
    src = padded_sources(model, LENGTHS)
    got = model.translate(src, beam_size=1, n_best=3, max_len_a=0.5, max_len_b=5, sampling_topk=0,
                          target_prefix=PREFIXES)
    for prefix, sentence in zip(PREFIXES, got):
        assert len(sentence) == 3
        assert all(h.tokens[:len(prefix or [])] == (prefix or []) for h in sentence)
        assert [h.score for h in sentence] == sorted((h.score for h in sentence), reverse=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sampling_topp=0.0), "sampling_topp must be in"),
    (dict(sampling_topp=1.5), "sampling_topp must be in"),
    (dict(sampling_temperature=0.0), "sampling_temperature must be"),
    (dict(sampling_temperature=-1.0), "sampling_temperature must be"),
    (dict(sampling_topk=-1), "sampling_topk must be >= 0"),
    (dict(sampling_topk=10, beam_size=4), "stochastic beam search"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be"),
    (dict(n_best=5, beam_size=4), "n_best must be in"),
    (dict(target_prefix=[[5, 100]]), "holds id 100"),
    (dict(target_prefix=[[5, 2]]), "holds id 2"),
    (dict(target_prefix=[[5] * 6]), "more than its length limit of 5"),
    (dict(target_prefix=[[5], [6]]), "one entry per sentence"),
])
def test_bad_options_are_named_before_any_work(kwargs, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        model.translate(padded_sources(model, [3]), **dict(dict(max_len_a=0.0, max_len_b=5), **kwargs))


@pytest.mark.parametrize("prefix", [[5.0], ["5"], [True]], ids=["float", "str", "bool"])
def test_a_prefix_id_that_is_not_an_integer_is_named(prefix):
    model = make_model()
    with pytest.raises(TypeError, match="target_prefix of sentence 0 holds .*: token ids must be integers"):
        model.translate(padded_sources(model, [3]), target_prefix=[prefix])


def test_prefix_ids_may_be_numpy_or_tensor_integers():
    model = make_model()
    src = padded_sources(model, [3, 4])
    plain = model.translate(src, target_prefix=[[5, 6], [7]])
    assert model.translate(src, target_prefix=[numpy.array([5, 6]), torch.tensor([7])]) == plain


def test_ctranslate2_returns_the_same_hypotheses(tmp_path):
    """CTranslate2 on the same weights: beam 4, length penalty 0 (a prefix's log-probability is a constant of all
    of a sentence's hypotheses, which CTranslate2 leaves out of its scores and fastformer keeps), EOS barred up to
    the prefix's end (CTranslate2 bars EOS in the beams after the first there)."""
    pytest.importorskip("ctranslate2")
    from test_export import (CONFIGS, MAX_LEN, export, model_ending_at_varied_lengths, pieces, source_batch,
                             vocabulary_for)

    model = model_ending_at_varied_lengths(17, beam_size=4, search_options=dict(length_penalty=0.0),
                                           **CONFIGS["post-ln-swish-unscaled-bias"])
    config = model.config
    src = source_batch(config)
    tokens = vocabulary_for(config)
    prefixes = [[4 + i, 5 + i] for i in range(src.shape[0])]
    translator = export(model, tmp_path)
    cases = [dict(target_prefix=prefixes), dict(no_repeat_ngram_size=2), dict(repetition_penalty=1.5),
             dict(no_repeat_ngram_size=1, repetition_penalty=0.8)]
    for options in cases:
        min_len = 3 if "target_prefix" in options else 0
        expected = model.translate(src, beam_size=4, length_penalty=0.0, max_len_a=0.0, max_len_b=MAX_LEN,
                                   min_len=min_len, **options)
        ct2_options = dict(options)
        if "target_prefix" in ct2_options:
            ct2_options["target_prefix"] = [[tokens[i] for i in p] for p in prefixes]
        results = translator.translate_batch([pieces(s, config) for s in src], beam_size=4, length_penalty=0.0,
                                             min_decoding_length=min_len, max_decoding_length=MAX_LEN + 1,
                                             **ct2_options)
        got = [[tokens.index(p) for p in r.hypotheses[0]] for r in results]
        assert got == [h[0].tokens for h in expected], options


def test_translator_passes_every_option_through(tiny_checkpoint):
    """Translator.translate (text prefixes, batches sorted by length) against each sentence alone through
    Transformer.translate with the prefix's pieces."""
    path, model, tokenizer = tiny_checkpoint
    sources = CALIBRATION[:6]
    prefixes = ["Der", None, "Die kleine", None, "Ein", None]
    options = dict(beam_size=1, sampling_topk=0, sampling_temperature=0.7, seed=4, no_repeat_ngram_size=2,
                   repetition_penalty=1.2)
    expected = []
    for ids, prefix in zip(tokenizer.encode(sources), prefixes):
        prefix_ids = tokenizer.encode([prefix])[0] if prefix else None
        best = model.translate(torch.tensor([ids + [EOS_ID]]), target_prefix=[prefix_ids], **options)[0][0]
        assert best.tokens[:len(prefix_ids or [])] == (prefix_ids or [])
        expected.append(tokenizer.decode([best.tokens])[0])
    translator = fastformer.load_translator(path, device="cpu")
    assert translator.translate(sources, target_prefix=prefixes, batch_tokens=40, **options) == expected
    with pytest.raises(ValueError, match="target_prefix has 2 entries for 6 sentences"):
        translator.translate(sources, target_prefix=prefixes[:2])


# GPU: the same rules on the CUDA kernels (the forced tokens in beam_step's kernel, the ATen rules inside the
# bucketed search's CUDA graphs). The reference runs under the "reference" backend (plain PyTorch fp32).

@pytest.mark.gpu
@pytest.mark.parametrize("shrink", ["every_step", "buckets"])
@pytest.mark.parametrize("name", OPTIONS)
def test_cuda_options_match_the_reference_search(name, shrink):
    model = make_model(eos_scale=1.5).cuda()
    src = padded_sources(model, LENGTHS).cuda()
    search = dict(beam_size=4, n_best=4, max_len_a=0.5, max_len_b=5, **OPTIONS[name])
    with fastformer.backend("reference"):
        assert_same_hypotheses(model.translate(src, shrink=shrink, **search), beam_search(model, src, **search),
                               atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [SAMPLING, dict(SAMPLING, target_prefix=PREFIXES, repetition_penalty=1.2,
                                                    sampling_topk=0, n_best=5)])
def test_cuda_sampling_is_the_same_alone_in_a_batch_and_in_buckets(options):
    model = make_model(eos_scale=1.5).cuda()
    src = padded_sources(model, LENGTHS).cuda()
    search = dict(dict(max_len_a=0.5, max_len_b=5), **options)
    every_step = model.translate(src, shrink="every_step", **search)
    for _ in range(2):  # the second search replays the buckets' graphs from a warm start
        assert_same_hypotheses(model.translate(src, shrink="buckets", **search), every_step, atol=1e-4)
    for i, length in enumerate(LENGTHS):
        alone = dict(search, target_prefix=[PREFIXES[i]]) if "target_prefix" in search else search
        assert [h.tokens for h in model.translate(src[i:i + 1, :length], **alone)[0]] == \
            [h.tokens for h in every_step[i]]
