"""Beam search: the reference against brute force, and translate (the compiled decoder) against the reference."""

import functools
import itertools
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import Transformer, TransformerConfig
from fastformer.decoding.compiled import extension
from fastformer.decoding.rules import eval_mode
from fastformer.reference.beam_search import Hypothesis, beam_search, length_penalty_divisor

VOCAB = 24


# The models are tiny: one intra-op thread is faster, and far faster on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(norm_first: bool = False, vocab: int = VOCAB, seed: int = 0, eos_scale: float = 1.0,
               **overrides) -> Transformer:
    """A tiny random model; eos_scale > 1 scales EOS's (tied) embedding, so that EOS wins at varied steps instead of
    every hypothesis running to max_len."""
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig.tiny(vocab, norm_first=norm_first, dropout=0.0, **overrides)).eval()
    with torch.no_grad():
        model.embed_tokens.weight[model.config.eos_id].mul_(eos_scale)
        if model.output_bias is not None:  # a zero bias would test nothing
            model.output_bias.normal_(0.0, 1.0)
    return model


def padded_sources(model: Transformer, lengths: list[int], seed: int = 1) -> torch.Tensor:
    """-> [len(lengths), max(lengths)] right-padded random sources, each ending with EOS."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    real_tokens = torch.tensor(real_token_ids(config))
    src = torch.full((len(lengths), max(lengths)), config.pad_id)
    for row, length in enumerate(lengths):
        src[row, :length - 1] = real_tokens[torch.randint(len(real_tokens), (length - 1,), generator=generator)]
        src[row, length - 1] = config.eos_id
    return src


def real_token_ids(config: TransformerConfig) -> list[int]:
    """The ids that are neither PAD, BOS nor EOS."""
    return [t for t in range(config.vocab_size) if t not in (config.pad_id, config.bos_id, config.eos_id)]


def brute_force(model: Transformer, src: torch.Tensor, max_len: int, min_len: int, length_penalty: float,
                length_penalty_form: str = "gnmt") -> list[Hypothesis]:
    """src: [1, src_len] -> every target of min_len..max_len real tokens, scored by teacher forcing, best first.

    |Y| counts the real tokens and EOS: GNMT's ((5 + |Y|) / 6) ** alpha, or |Y| ** alpha as transformers' generate
    divides an encoder-decoder hypothesis (cur_len + 1 - decoder_prompt_len, the tokens after the start token)."""
    config = model.config
    real_tokens = real_token_ids(config)
    encoder_out = model.encode(src)
    hypotheses = []
    for length in range(min_len, max_len + 1):
        for tokens in itertools.product(real_tokens, repeat=length):
            tgt_in = torch.tensor([[config.bos_id, *tokens]])
            tgt_out = torch.tensor([*tokens, config.eos_id])
            log_probs = F.log_softmax(model.decode(tgt_in, encoder_out)[0].float(), dim=-1)
            total = log_probs[torch.arange(length + 1), tgt_out].sum().item()
            n = length + 1
            divisor = ((5 + n) / 6) ** length_penalty if length_penalty_form == "gnmt" else n ** length_penalty
            hypotheses.append(Hypothesis(list(tokens), total / divisor))
    return sorted(hypotheses, key=lambda h: -h.score)


# How far a sentence's score may move between a batch and alone where the GEMMs round a row by the batch's row
# count (gemm_rows_depend_on_the_batch): ~1e-6 in float32; int8 and bfloat16 move more, since such a difference can
# flip a rounding to 8 or 16 bits downstream (0.015 seen in int8 on the GPU machine's Intel Xeon).
BATCH_VARIANT_ATOL = {"float32": 1e-5, "int8": 0.05, "bfloat16": 0.05}


def gemm_rows_depend_on_the_batch(model: Transformer, compute_type: str) -> bool:
    """Whether the GEMMs the compiled search runs the model's linear layers with (in compute_type, and the float32
    ones it keeps) give a row another result in a batch of rows than alone on this CPU: a translation is then
    batch-invariant only to within that rounding. Not on CI's AMD EPYC; oneDNN's bfloat16 GEMM does on AVX-512
    without BF16 instructions (ONEDNN_MAX_CPU_ISA=AVX512_CORE there), and every float32 shape does on the GPU
    machine's Intel Xeon with oneDNN capped to AVX2 (benchmarks/results/2026-11-27-nvidia-h200-b/)."""
    shapes = tuple(sorted({tuple(p.shape) for p in model.parameters() if p.dim() == 2}))
    return _gemm_rows_depend_on_the_batch(shapes, compute_type)


@functools.lru_cache
def _gemm_rows_depend_on_the_batch(shapes: tuple[tuple[int, int], ...], compute_type: str) -> bool:
    from fastformer.decoding.compiled import DECODER_ROWS, ENCODER_ROWS
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        rows = torch.randn(64, in_features, generator=generator)
        for dtype in sorted({"float32", compute_type}):
            for packed_rows in (DECODER_ROWS, 8 * DECODER_ROWS, ENCODER_ROWS):  # as the search packs its weights
                linear = extension().PackedLinear(weight, bias, packed_rows, dtype)
                batch = linear(rows)
                # Each row alone and each leading run of rows against the same rows in the whole batch.
                if any(not torch.equal(linear(rows[row:row + 1]), batch[row:row + 1]) or
                       not torch.equal(linear(rows[:row + 1]), batch[:row + 1]) for row in range(len(rows))):
                    return True
    return False


def batch_invariance_atol(model: Transformer, compute_type: str) -> float:
    """0 (scores equal bitwise) where this CPU's GEMMs round a row alike in any batch, else BATCH_VARIANT_ATOL."""
    return BATCH_VARIANT_ATOL[compute_type] if gemm_rows_depend_on_the_batch(model, compute_type) else 0.0


def assert_same_hypotheses(got: list[list[Hypothesis]], expected: list[list[Hypothesis]], atol: float = 1e-5) -> None:
    assert len(got) == len(expected)
    for sentence, (got_hyps, expected_hyps) in enumerate(zip(got, expected)):
        assert [h.tokens for h in got_hyps] == [h.tokens for h in expected_hyps], f"sentence {sentence}"
        for g, e in zip(got_hyps, expected_hyps):
            assert g.score == pytest.approx(e.score, abs=atol, rel=0), f"sentence {sentence}: {g} vs {e}"


@pytest.mark.parametrize("length_penalty_form", ["gnmt", "length"])
@pytest.mark.parametrize("min_len,length_penalty", [(1, 0.6), (0, 1.0), (2, 0.0), (1, 2.0)])
def test_reference_finds_the_exact_optimum_with_a_large_beam(min_len, length_penalty, length_penalty_form):
    # 3 real tokens and at most 3 of them: at most 36 candidates a step, so a beam of 40 is exhaustive.
    model = make_model(vocab=6)
    src = padded_sources(model, [4])
    expected = brute_force(model, src, max_len=3, min_len=min_len, length_penalty=length_penalty,
                           length_penalty_form=length_penalty_form)
    got = beam_search(model, src, beam_size=40, length_penalty=length_penalty, max_len_a=0.0, max_len_b=3,
                      min_len=min_len, n_best=len(expected), length_penalty_form=length_penalty_form)
    assert_same_hypotheses(got, [expected])


@pytest.mark.parametrize("search", ["reference", "translate", "translate without scores"])
def test_beam_one_is_greedy_search(search):
    model = make_model()
    src = padded_sources(model, [7, 4, 9])
    encoder_out = model.encode(src)
    config = model.config
    kwargs = dict(beam_size=1, max_len_a=0.0, max_len_b=12, min_len=2, length_penalty=0.6)
    got = (beam_search(model, src, **kwargs) if search == "reference"
           else model.translate(src, return_scores=search == "translate", **kwargs))
    for sentence in range(src.shape[0]):
        tokens, total = [], 0.0
        one = encoder_out._replace(memory=encoder_out.memory[sentence:sentence + 1],
                                   src_lengths=encoder_out.src_lengths[sentence:sentence + 1])
        while True:
            log_probs = F.log_softmax(model.decode(torch.tensor([[config.bos_id, *tokens]]), one)[0, -1], dim=-1)
            log_probs[[config.pad_id, config.bos_id]] = float("-inf")
            if len(tokens) < 2:
                log_probs[config.eos_id] = float("-inf")
            token = config.eos_id if len(tokens) == 12 else int(log_probs.argmax())
            total += log_probs[token].item()
            if token == config.eos_id:
                break
            tokens.append(token)
        assert got[sentence][0].tokens == tokens
        if search == "translate without scores":  # the argmax alone, without a log-softmax
            assert got[sentence][0].score is None
        else:
            assert got[sentence][0].score == pytest.approx(total / length_penalty_divisor(len(tokens) + 1, 0.6),
                                                           abs=1e-5)


@pytest.mark.parametrize("shrink", ["every_step", "buckets"])
@pytest.mark.parametrize("compute_type", ["float32", "int8"])
def test_greedy_search_without_scores_takes_the_tokens_of_the_scored_search_in_any_batch(shrink, compute_type):
    """Greedy search's own path (the argmax, no log-softmax) against beam 1 with scores, in a batch of sentences of
    several lengths and for each sentence alone, with EOS barred for a while (min_len) and forced (max_len)."""
    model = make_model(vocab=300)  # a vocabulary past a few vector widths, with a tail
    src = padded_sources(model, [7, 4, 9, 1, 12])
    kwargs = dict(beam_size=1, max_len_a=0.5, max_len_b=3, min_len=3, shrink=shrink, compute_type=compute_type)
    scored = model.translate(src, **kwargs)
    unscored = model.translate(src, return_scores=False, **kwargs)
    tokens = [[[h.tokens for h in sentence] for sentence in search] for search in (scored, unscored)]
    assert tokens[0] == tokens[1]
    assert all(h.score is None for sentence in unscored for h in sentence)
    for i in range(src.shape[0]):
        length = int((src[i] != model.config.pad_id).sum())
        alone = model.translate(src[i:i + 1, :length], return_scores=False, **kwargs)
        assert alone[0][0].tokens == scored[i][0].tokens


# translate: the compiled decoder against the reference (full recompute each step).

SEARCHES = [
    # (beam_size, n_best, min_len, max_len_a, max_len_b, length_penalty)
    *[(beam, beam, 1, 1.0, 8, 0.6) for beam in range(1, 9)],
    (3, 1, 4, 1.0, 8, 0.6),
    (4, 2, 0, 0.5, 3, 1.0),
    (5, 3, 2, 2.0, 0, 0.0),
    (6, 6, 1, 0.0, 2, 0.6),
]


def assert_translate_matches_reference(model: Transformer, src: torch.Tensor, **search) -> None:
    expected = beam_search(model, src, **search)
    got = model.translate(src, **search)
    assert all(isinstance(h, Hypothesis) for hyps in got for h in hyps)
    assert_same_hypotheses(got, expected)


# How the batch shrinks as sentences finish (fastformer/decoding/search.py): "buckets" is CUDA's default, run here on
# the CPU without graphs. Six sentences of different lengths go through buckets of 6, 4, 2 and 1, some padded with
# finished sentences.
SHRINKS = ["every_step", "buckets"]


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("beam_size,n_best,min_len,max_len_a,max_len_b,length_penalty", SEARCHES)
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_translate_matches_reference(norm_first, activation, beam_size, n_best, min_len, max_len_a, max_len_b,
                                     length_penalty, shrink):
    model = make_model(norm_first, activation=activation, eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9], seed=beam_size)
    search = dict(beam_size=beam_size, n_best=n_best, min_len=min_len, max_len_a=max_len_a, max_len_b=max_len_b,
                  length_penalty=length_penalty)
    assert_same_hypotheses(model.translate(src, shrink=shrink, **search), beam_search(model, src, **search))


# Marian/OPUS-MT model options, one at a time and all together (Marian starts from pad, and its EOS is id 0).
MARIAN = dict(activation="swish", scale_embedding=False, output_bias=True, position_layout="halves",
              pad_id=VOCAB - 1, bos_id=VOCAB - 1, eos_id=0)
MODEL_OPTIONS = [
    pytest.param(False, dict(activation="swish"), id="swish"),
    pytest.param(False, dict(scale_embedding=False), id="unscaled-embedding"),
    pytest.param(True, dict(activation="gelu", scale_embedding=False), id="pre-ln-unscaled-embedding"),
    pytest.param(False, dict(output_bias=True), id="output-bias"),
    pytest.param(False, dict(position_layout="halves"), id="halves"),
    pytest.param(False, dict(pad_id=VOCAB - 1, bos_id=VOCAB - 1, eos_id=0), id="pad-is-bos-eos-0"),
    pytest.param(False, MARIAN, id="marian"),
    pytest.param(True, MARIAN, id="marian-pre-ln"),
]


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("norm_first,options", MODEL_OPTIONS)
def test_translate_matches_reference_for_each_model_option(norm_first, options, shrink):
    model = make_model(norm_first, eos_scale=8.0, **options)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9], seed=5)
    search = dict(beam_size=4, n_best=4, min_len=1, max_len_a=1.0, max_len_b=6)
    assert_same_hypotheses(model.translate(src, shrink=shrink, **search), beam_search(model, src, **search))


def test_sentence_groups_keep_enough_rows_for_their_gemms():
    """csrc/search.cpp's rule: one group a thread where each keeps 16 rows for every byte of a weight (int8 16,
    bfloat16 32, float32 64), else one group; never more groups than threads or sentences."""
    groups = extension().cpu_sentence_groups
    assert groups(64, 256, "float32", 2) == 2  # beam 4 of 64 sentences: 128 rows a group
    assert groups(64, 64, "float32", 2) == 1  # greedy search: 32 rows a group would be too few
    assert groups(32, 127, "float32", 2) == 1 and groups(32, 128, "float32", 2) == 2
    assert groups(16, 63, "bfloat16", 2) == 1 and groups(16, 64, "bfloat16", 2) == 2
    assert groups(8, 31, "int8", 2) == 1 and groups(8, 32, "int8", 2) == 2
    assert groups(70, 210, "float32", 3) == 3 and groups(64, 4096, "int8", 16) == 16
    assert groups(2, 400, "float32", 3) == 2  # scoring: many target tokens, two sentences
    assert groups(64, 256, "int8", 1) == 1 and groups(0, 0, "int8", 2) == 1


def test_translate_splits_sentences_across_threads_without_changing_results():
    """With several intra-op threads the CPU search runs groups of sentences side by side (float32: each of at least
    64 rows, a sentence's beams): 70 sentences of beam 3 on 3 threads are 3 groups of different lengths. A vocabulary
    of 37 leaves a partial vector."""
    model = make_model(vocab=37, eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9, 3, 8, 6, 2, 5, 7, 1, 4] * 5, seed=3)
    search = dict(beam_size=3, n_best=3, min_len=1, max_len_a=1.0, max_len_b=5)
    assert extension().cpu_sentence_groups(len(src), 3 * len(src), "float32", 3) == 3
    one_thread = model.translate(src, **search)
    torch.set_num_threads(3)
    try:
        grouped = model.translate(src, **search)
        grouped_in_buckets = model.translate(src, shrink="buckets", **search)
    finally:
        torch.set_num_threads(1)
    assert_same_hypotheses(grouped, one_thread)
    assert_same_hypotheses(grouped_in_buckets, one_thread)
    assert_same_hypotheses(grouped, beam_search(model, src, **search))


def test_translate_in_buckets_when_every_sentence_ends_at_the_first_step():
    # max_len 0: EOS is forced at step 0, so the bucketed search stops before its first look at the done flags.
    model = make_model(eos_scale=8.0)
    src = padded_sources(model, [3, 5, 2], seed=6)
    search = dict(beam_size=2, n_best=2, max_len_a=0.0, max_len_b=0)
    got = model.translate(src, shrink="buckets", **search)
    assert all(h.tokens == [] for hyps in got for h in hyps)
    assert_same_hypotheses(got, beam_search(model, src, **search))


def test_translate_never_emits_pad_when_it_is_bos():
    # Pad (= BOS) made the likeliest token everywhere: the search must still never emit it.
    model = make_model(eos_scale=8.0, **MARIAN)
    with torch.no_grad():
        model.output_bias[model.config.pad_id] = 50.0
    src = padded_sources(model, [5, 3], seed=2)
    got = model.translate(src, beam_size=3, n_best=3, max_len_b=6)
    # Scores near -100 (the bias of 50 on pad is in every log-softmax): fp32 rounding is ~1e-5 there.
    assert_same_hypotheses(got, beam_search(model, src, beam_size=3, n_best=3, max_len_b=6), atol=1e-4)
    assert all(model.config.pad_id not in h.tokens for hyps in got for h in hyps)


@pytest.mark.parametrize("beam_size,n_best,min_len,max_len_a,max_len_b,length_penalty", SEARCHES[::3])
def test_translate_matches_reference_with_the_length_form(beam_size, n_best, min_len, max_len_a, max_len_b,
                                                          length_penalty):
    model = make_model(eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9], seed=beam_size)
    assert_translate_matches_reference(model, src, beam_size=beam_size, n_best=n_best, min_len=min_len,
                                       max_len_a=max_len_a, max_len_b=max_len_b, length_penalty=length_penalty,
                                       length_penalty_form="length")


def test_translate_is_inference_whatever_the_models_mode():
    """The compiled search and the reference oracle alike: a model in training mode is searched without dropout."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(VOCAB, dropout=0.3, attention_dropout=0.3))
    src = padded_sources(model, [7, 2, 5, 9], seed=3)
    expected = model.eval().translate(src, beam_size=3, n_best=3, max_len_b=8)
    model.train()
    model.decoder.eval()  # a mixed state, given back as it was
    for _ in range(2):
        assert_same_hypotheses(model.translate(src, beam_size=3, n_best=3, max_len_b=8), expected)
        assert_same_hypotheses(beam_search(model, src, beam_size=3, n_best=3, max_len_b=8), expected)
    assert model.training and model.encoder.training and model.embed_dropout.training
    assert not model.decoder.training and not model.decoder.layers[0].training


def test_threads_translating_one_model_keep_eval_mode_until_the_last_ends():
    """Threads translate one model at once (the search releases the GIL), their eval_mode blocks overlapping without
    nesting: the model stays in eval mode until the last block ends, which gives every module its mode back."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(VOCAB, dropout=0.3, attention_dropout=0.3)).train()
    first, second = eval_mode(model), eval_mode(model)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not any(module.training for module in model.modules()), "the second block runs on in eval mode"
    second.__exit__(None, None, None)
    assert all(module.training for module in model.modules())
    sources = [padded_sources(model, [7, 2, 5, 9], seed=seed) for seed in range(8)]
    expected = [model.eval().translate(src, beam_size=2, max_len_b=8) for src in sources]
    model.train()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda src: model.translate(src, beam_size=2, max_len_b=8), sources * 3))
    for got, want in zip(results, expected * 3):
        assert_same_hypotheses(got, want)
    assert all(module.training for module in model.modules())


def put_non_finite_weight(model: Transformer, where: str) -> None:
    """An inf in the output bias, or a NaN in the encoder's or decoder's first feed-forward weight."""
    with torch.no_grad():
        if where == "output_bias":
            model.output_bias[5] = float("inf")
        else:
            getattr(model, where).layers[0].ffn.linear1.weight[0, 0] = float("nan")


@pytest.mark.parametrize("where", ["encoder", "decoder", "output_bias"])
def test_translate_rejects_a_model_with_non_finite_weights(where):
    model = make_model(output_bias=True)
    put_non_finite_weight(model, where)
    with pytest.raises(RuntimeError, match="not finite"):
        model.translate(padded_sources(model, [4, 3]))


def test_translate_matches_reference_when_every_hypothesis_runs_to_max_len():
    # With no boost EOS hardly ever wins before it is forced: the batch shrinks only by max_len.
    model = make_model(seed=3)
    src = padded_sources(model, [9, 3, 6, 2, 8, 5], seed=7)
    assert_translate_matches_reference(model, src, beam_size=4, n_best=4, max_len_a=1.0, max_len_b=4)


def test_translate_caps_max_len_at_max_positions():
    model = make_model(max_positions=8)
    src = padded_sources(model, [6, 3])
    got = model.translate(src, beam_size=3, n_best=3, max_len_a=0.0, max_len_b=50)
    assert_same_hypotheses(got, beam_search(model, src, beam_size=3, n_best=3, max_len_a=0.0, max_len_b=50))
    assert max(len(h.tokens) for hyps in got for h in hyps) <= 7


@pytest.mark.parametrize("length_penalty_form,length_penalty", [("gnmt", 0.6), ("length", 1.0), ("length", 2.0)])
def test_translate_finds_the_exact_optimum_with_a_large_beam(length_penalty_form, length_penalty):
    model = make_model(vocab=6, norm_first=True)
    src = padded_sources(model, [3])
    expected = brute_force(model, src, max_len=3, min_len=1, length_penalty=length_penalty,
                           length_penalty_form=length_penalty_form)
    got = model.translate(src, beam_size=40, length_penalty=length_penalty, max_len_a=0.0, max_len_b=3, min_len=1,
                          n_best=len(expected), length_penalty_form=length_penalty_form)
    assert_same_hypotheses(got, [expected])


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_cli_takes_the_length_penalty_form(command):
    from fastformer.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args([command]).length_penalty_form == "gnmt"
    assert parser.parse_args([command, "--length-penalty-form", "length"]).length_penalty_form == "length"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--length-penalty-form", "fairseq"])


def test_translate_of_an_empty_batch_is_empty():
    model = make_model()
    assert model.translate(torch.zeros(0, 4, dtype=torch.long)) == []


@pytest.mark.parametrize("kwargs,error", [
    (dict(beam_size=0), ValueError),
    (dict(beam_size=2, n_best=3), ValueError),
    (dict(n_best=0), ValueError),
    (dict(min_len=-1), ValueError),
    (dict(max_len_a=-1.0), ValueError),
    (dict(max_len_b=-2), ValueError),
    (dict(length_penalty=float("nan")), ValueError),
    (dict(length_penalty=1e30), ValueError),
    (dict(length_penalty=-1e30, length_penalty_form="length"), ValueError),
    (dict(beam_size=2.0), TypeError),
    (dict(length_penalty_form="fairseq"), ValueError),
    (dict(shrink="never"), ValueError),
])
def test_translate_rejects_bad_arguments(kwargs, error):
    model = make_model()
    with pytest.raises(error):
        model.translate(padded_sources(model, [3]), **kwargs)


@pytest.mark.parametrize("src,match", [
    (torch.zeros(2, 0, dtype=torch.long), "len >= 1"),
    (torch.tensor([[5, 2], [0, 0]]), "all padding"),
    (torch.tensor([[5.0, 2.0]]), "int64 or int32"),
    (torch.tensor([[5, VOCAB]]), "outside"),
])
def test_translate_rejects_bad_sources(src, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_model().translate(src)


# The incremental decoder step by step against the full recompute.

@pytest.mark.parametrize("norm_first,options", [(False, dict(activation="relu")), (True, dict(activation="gelu")),
                                                *MODEL_OPTIONS])
def test_cached_decoder_logits_match_full_recompute(norm_first, options):
    from fastformer.decoding.search import cached_decoder
    from tolerances import FP32

    model = make_model(norm_first, **options)
    config = model.config
    beam_size, length = 3, 6
    src = padded_sources(model, [5, 2, 7])
    encoder_out = model.encode(src)
    n_slots = src.shape[0] * beam_size
    # Every slot decodes its own random target: [BOS, y1 .. y5].
    real_tokens = torch.tensor(real_token_ids(config))
    targets = real_tokens[torch.randint(len(real_tokens), (n_slots, length), generator=torch.Generator().manual_seed(2))]
    targets[:, 0] = config.bos_id
    decoder = cached_decoder(model, encoder_out, beam_size, cache_len=length)
    row_slots = torch.arange(n_slots, dtype=torch.int32)
    indirection = (row_slots % beam_size)[:, None].expand(n_slots, length).contiguous()
    beams_out = encoder_out._replace(memory=encoder_out.memory.repeat_interleave(beam_size, dim=0),
                                     src_lengths=encoder_out.src_lengths.repeat_interleave(beam_size))
    expected = model.decode(targets, beams_out)  # [n_slots, length, vocab]
    for step in range(length):
        logits = decoder.step(targets[:, step], row_slots, indirection, step)
        torch.testing.assert_close(logits, expected[:, step], **FP32)
    # A subset of the rows (as after sentences finish) still reads its own cache.
    fresh = cached_decoder(model, encoder_out, beam_size, cache_len=length)
    subset = torch.tensor([7, 8, 0], dtype=torch.int32)
    for step in range(length):
        logits = fresh.step(targets[subset.long(), step], subset, indirection, step)
        torch.testing.assert_close(logits, expected[subset.long(), step], **FP32)


# GPU: the CUDA kernels. The reference runs under the "reference" backend (plain PyTorch fp32, no TF32 Triton dots).

def cuda_model(norm_first: bool = False, **kwargs) -> Transformer:
    return make_model(norm_first, **kwargs).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("shrink", SHRINKS)  # buckets: the CUDA graphs of each bucket's step
@pytest.mark.parametrize("beam_size,n_best,min_len,max_len_a,max_len_b,length_penalty", SEARCHES)
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_cuda_translate_matches_reference(norm_first, activation, beam_size, n_best, min_len, max_len_a, max_len_b,
                                          length_penalty, shrink):
    model = cuda_model(norm_first, activation=activation, eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9], seed=beam_size).cuda()
    search = dict(beam_size=beam_size, n_best=n_best, min_len=min_len, max_len_a=max_len_a, max_len_b=max_len_b,
                  length_penalty=length_penalty)
    with fastformer.backend("reference"):
        assert_same_hypotheses(model.translate(src, shrink=shrink, **search), beam_search(model, src, **search),
                               atol=1e-4)


@pytest.mark.gpu
def test_cuda_translate_in_buckets_of_many_sentences_matches_every_step():
    # 40 sentences of lengths 1..20: buckets of 40, 32, 16, 8, 4, 2 and 1, each captured as a graph once it runs a
    # second step; the search runs twice, so the second one starts from a warm cuBLAS and caching allocator.
    model = cuda_model(eos_scale=8.0)
    lengths = torch.randint(1, 21, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    src = padded_sources(model, lengths, seed=9).cuda()
    search = dict(beam_size=4, n_best=2, max_len_b=12)
    with fastformer.backend("reference"):
        every_step = model.translate(src, shrink="every_step", **search)
        for _ in range(2):
            assert_same_hypotheses(model.translate(src, shrink="buckets", **search), every_step, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("beam_size", [8, 32])
def test_cuda_translate_matches_reference_with_a_large_vocabulary(beam_size):
    # Many candidates per thread of the beam-step kernel, and its largest candidate lists.
    model = cuda_model(vocab=3000, eos_scale=8.0)
    src = padded_sources(model, [12, 3, 8, 20], seed=11).cuda()
    search = dict(beam_size=beam_size, n_best=4, max_len_a=0.5, max_len_b=6)
    with fastformer.backend("reference"):
        assert_same_hypotheses(model.translate(src, **search), beam_search(model, src, **search), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("norm_first,options", MODEL_OPTIONS)
def test_cuda_translate_matches_reference_for_each_model_option(norm_first, options, shrink):
    model = cuda_model(norm_first, eos_scale=8.0, **options)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9], seed=5).cuda()
    search = dict(beam_size=4, n_best=4, max_len_a=1.0, max_len_b=6)
    with fastformer.backend("reference"):
        assert_same_hypotheses(model.translate(src, shrink=shrink, **search), beam_search(model, src, **search),
                               atol=1e-4)


@pytest.mark.gpu
def test_cuda_translate_matches_reference_with_the_length_form():
    model = cuda_model(eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9], seed=4).cuda()
    search = dict(beam_size=4, n_best=4, max_len_b=8, length_penalty=1.0, length_penalty_form="length")
    with fastformer.backend("reference"):
        assert_same_hypotheses(model.translate(src, **search), beam_search(model, src, **search), atol=1e-4)


@pytest.mark.gpu
def test_cuda_translate_rejects_a_beam_over_the_kernel_limit():
    model = cuda_model()
    with pytest.raises(ValueError, match="beam_size must be <= 32"):
        model.translate(padded_sources(model, [4]).cuda(), beam_size=33)


@pytest.mark.gpu
@pytest.mark.parametrize("norm_first", [False, True])
def test_cuda_cached_decoder_logits_match_full_recompute(norm_first):
    from fastformer.decoding.search import cached_decoder
    from tolerances import FP32

    model = cuda_model(norm_first)
    beam_size, length = 2, 8
    src = padded_sources(model, [6, 3, 9]).cuda()
    with fastformer.backend("reference"):
        encoder_out = model.encode(src)
        n_slots = src.shape[0] * beam_size
        targets = torch.randint(3, VOCAB, (n_slots, length), generator=torch.Generator().manual_seed(2)).cuda()
        targets[:, 0] = model.config.bos_id
        beams_out = encoder_out._replace(memory=encoder_out.memory.repeat_interleave(beam_size, dim=0),
                                         src_lengths=encoder_out.src_lengths.repeat_interleave(beam_size))
        expected = model.decode(targets, beams_out)
    decoder = cached_decoder(model, encoder_out, beam_size, cache_len=length)
    row_slots = torch.arange(n_slots, dtype=torch.int32, device="cuda")
    indirection = (row_slots % beam_size)[:, None].expand(n_slots, length).contiguous()
    for step in range(length):
        torch.testing.assert_close(decoder.step(targets[:, step], row_slots, indirection, step), expected[:, step],
                                   **FP32)


# Low precision: the best hypothesis of an fp16/bf16 model against the same model in fp32 (both compiled; fp32 is
# checked against the reference above). Near-ties may flip a few sentences, so only most must be identical.
LOWP_TOLERANCES = [(torch.float16, 0.05, 0.75), (torch.bfloat16, 0.2, 0.5)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,score_tolerance,min_identical", LOWP_TOLERANCES)
@pytest.mark.parametrize("norm_first", [False, True])
def test_cuda_translate_low_precision(norm_first, dtype, score_tolerance, min_identical):
    model = cuda_model(norm_first, eos_scale=8.0)
    lengths = torch.randint(1, 15, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    src = padded_sources(model, lengths, seed=4).cuda()
    expected = model.translate(src, beam_size=4, max_len_b=10)
    got = model.to(dtype).translate(src, beam_size=4, max_len_b=10)
    identical = sum(g[0].tokens == e[0].tokens for g, e in zip(got, expected)) / len(expected)
    assert identical >= min_identical, f"only {identical:.0%} of the best hypotheses are those of fp32"
    for g, e in zip(got, expected):
        assert math.isfinite(g[0].score) and abs(g[0].score - e[0].score) <= score_tolerance, (g, e)
