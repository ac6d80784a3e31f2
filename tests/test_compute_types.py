"""CPU compute types (fastformer/decoding/compiled.py): the converted linear layers against float64 products, the
compiled encoder against model.encode, and beam search in int8 and bfloat16 against brute force, greedy decoding and
itself on other batches. float32 translation is tested against the reference search in test_beam_search.py."""

import contextlib
import copy
import io
import itertools
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

from fastformer import Transformer, TransformerConfig
from fastformer.decoding.compiled import BFLOAT16_FALLBACK_WARNING, compiled_model, extension, resolve_compute_type
from fastformer.decoding.search import cached_decoder, encode
from fastformer.decoding.shortlist import Shortlist
from fastformer.model import EncoderOutput
from fastformer.reference.beam_search import Hypothesis
from test_beam_search import assert_same_hypotheses, make_model, padded_sources, real_token_ids
from tolerances import FP32, assert_close_lowp

CPU = torch.device("cpu")


# The models are tiny: one intra-op thread is faster, and far faster on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def no_bfloat16_warning():
    """The CPU may lack a bfloat16 GEMM (compiled.py warns once per conversion): not what these tests check."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="compute_type='bfloat16'")
        yield


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """n intra-op threads inside the block (the module runs on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def linear_inputs(rows: int = 37, in_features: int = 96, out_features: int = 130, seed: int = 0):
    """x [rows, in] with an outlier column and (from 6 rows) a zero row 5, weight [out, in], bias [out]."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    x[:, 3] *= 9.0  # an outlier channel, as real activations have: it sets every row's int8 scale
    if rows > 5:
        x[5] = 0.0
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator)
    return x, weight, bias


# The int8 GEMMs a linear layer can take (linear.h): fastformer's own where the CPU runs one (AVX512-VNNI's, or
# AVX-VNNI's or AVX2's: test_cpu_isa.py runs these tests under FASTFORMER_CPU_ISA=avx2 too), FBGEMM's, oneDNN's.
INT8_ROUTES = {"own": dict(), "fbgemm": dict(own_gemm=False), "onednn": dict(own_gemm=False, fbgemm=False)}


def int8_route(name: str) -> dict:
    """PackedLinear's keyword arguments for an int8 route; skips the test where the route does not run here."""
    if name == "own" and not extension().int8_gemm_runs():
        pytest.skip("fastformer's own int8 GEMMs need AVX512-VNNI, AVX-VNNI or AVX2 (FASTFORMER_CPU_ISA not "
                    "baseline)")
    return INT8_ROUTES[name]


def int8_route_name(name: str) -> str:
    """PackedLinear.route of an int8 route: the own one is named by its instruction set (8-bit rows: in the AVX-512
    loops AMX's where it runs, else VNNI's on 512-bit vectors; else VNNI's on 256-bit ones)."""
    if name == "own":
        if extension().int8_activation_max() < 127:
            return "avx2-int8"
        if extension().cpu_isa() == "avx512":
            return "amx-int8" if extension().cpu_has_amx() else "vnni-int8"
        return "avxvnni-int8"
    return f"{name}-int8"


# The float32 GEMMs (linear.h): fastformer's own where the CPU loops are AVX-512's or AVX2's, else oneDNN's.
FLOAT32_ROUTES = {"own": dict(), "onednn": dict(own_gemm=False)}


def float32_linear(weight: torch.Tensor, bias: torch.Tensor, route: str):
    """A float32 PackedLinear on a route; skips the test where fastformer's own GEMM does not run here."""
    linear = extension().PackedLinear(weight, bias, 16, "float32", **FLOAT32_ROUTES[route])
    if route == "own" and linear.route not in ("avx512-float32", "avx2-float32"):
        pytest.skip("fastformer's own float32 GEMMs run where the CPU loops are AVX-512's or AVX2's")
    return linear


def skip_without_float32_summary(compute_type: str) -> None:
    """Skips a float32 test of the output projection's summary where the AVX-512 GEMM does not run."""
    if compute_type == "float32" and extension().cpu_isa() != "avx512":
        pytest.skip("the float32 summary is the AVX-512 GEMM's (the CPU loops AVX-512's)")


def summarizing_linear(weight: torch.Tensor, bias: torch.Tensor, rows: int, compute_type: str):
    """A PackedLinear whose GEMM summarizes its outputs (own int8, avx512-float32); skips the test where none runs
    here."""
    skip_without_float32_summary(compute_type)
    route = int8_route("own") if compute_type == "int8" else {}
    linear = extension().PackedLinear(weight, bias, rows, compute_type, **route)
    assert linear.has_summary, linear.route
    return linear


@pytest.mark.parametrize("route", FLOAT32_ROUTES)
@pytest.mark.parametrize("rows,in_features,out_features",
                         [(1, 96, 130), (37, 96, 130), (32, 512, 1030), (250, 96, 130)])
def test_float32_linear_matches_float64(route, rows, in_features, out_features):
    """Shapes past the own GEMM's tile (6 rows, 16 outputs) and its balanced tiles (32 rows: 5 and 6); 250 rows: the
    rows split across threads, not the panels."""
    x, weight, bias = linear_inputs(rows, in_features, out_features)
    linear = float32_linear(weight, bias, route)
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(linear(x).double(), expected, **FP32)


def test_a_float32_row_does_not_depend_on_the_other_rows_in_the_own_gemm():
    """Each output is one chain of multiply-adds over the inputs in order, whatever tile of 1 to 6 rows holds it."""
    x, weight, bias = linear_inputs(rows=9)
    linear = float32_linear(weight, bias, "own")
    alone = torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])
    others = torch.randn(23, x.shape[1], generator=torch.Generator().manual_seed(4)) * 50.0
    assert torch.equal(linear(x), alone)
    assert torch.equal(linear(torch.cat([others, x, others / 1000]))[23:32], alone)
    many = torch.cat([others] * 10)  # 230 rows before x's: the rows split across threads, in parts not of 6
    with threads(2):
        assert torch.equal(linear(torch.cat([many, x, many]))[230:239], alone)


def test_bfloat16_linear_is_as_close_as_torch_in_bfloat16():
    x, weight, bias = linear_inputs()
    linear = extension().PackedLinear(weight, bias, 16, "bfloat16")
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch_bf16 = F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16())
    assert_close_lowp(linear(x), torch_bf16, expected, "bfloat16 linear")


@pytest.mark.parametrize("route", INT8_ROUTES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_linear_error_is_within_the_bound_of_its_scales(with_bias, route):
    """Per row i and output j: x = x_q s_i + e (|e| <= s_i / 2, s_i = max|x_i| / A, A = int8_activation_max(): 127
    with VNNI, else 63) and w = w_q t_j + f (|f| <= t_j / 2, t_j = max|w_j| / B, B = the layer's int8_weight_max:
    127, or 64 on the AVX2 GEMM), so |x.w - s_i t_j x_q.w_q| <= s_i / 2 sum|w_j| + t_j / 2 sum(|x_i| + s_i / 2)."""
    x, weight, bias = linear_inputs()
    bias = bias if with_bias else None
    linear = extension().PackedLinear(weight, bias, 16, "int8", **int8_route(route))
    assert linear.route == int8_route_name(route)
    got = linear(x).double()
    x64, w64 = x.double(), weight.double()
    expected = F.linear(x64, w64, bias.double() if with_bias else None)
    s = x64.abs().amax(dim=1, keepdim=True) / extension().int8_activation_max()
    t = w64.abs().amax(dim=1) / linear.int8_weight_max
    bound = s / 2 * w64.abs().sum(dim=1) + t / 2 * (x64.abs() + s / 2).sum(dim=1, keepdim=True)
    error = (got - expected).abs()
    assert (error <= bound * 1.001 + 1e-5).all(), f"max excess {(error - bound).max():.3e}"
    # A zero row is the bias exactly; the error is not trivially small elsewhere (the bound is a real one).
    torch.testing.assert_close(got[5], expected[5], atol=1e-6, rtol=0)
    assert error.max() > 1e-3


@pytest.mark.parametrize("route", ["own", "onednn"])  # FBGEMM rounds normalized rows: the bound test takes it
@pytest.mark.parametrize("rows,in_features,out_features", [(7, 97, 130), (37, 96, 130), (64, 512, 1030)])
def test_int8_linear_equals_its_quantized_product_in_integers(rows, in_features, out_features, route):
    """linear.h's formula, brute force: each row quantized to round(x * A / absmax) (A = int8_activation_max()), the
    weights to round(w / t) with t = max|w_j| / B (B = int8_weight_max), the integer products summed exactly, then
    scaled by the weights' scales, the rows' and the bias, in that order, in float32: equal up to the floats' last
    bits. Shapes past the own GEMMs' tiles (6 rows by 64 outputs, 4 by 16) and their groups of 4 and 8 inputs."""
    x, weight, bias = linear_inputs(rows, in_features, out_features)
    linear = extension().PackedLinear(weight, bias, 16, "int8", **int8_route(route))
    levels = extension().int8_activation_max()
    absmax = x.abs().amax(dim=1, keepdim=True)
    x_q = torch.where(absmax > 0, torch.round(x * (levels / absmax)), torch.zeros_like(x))
    x_scales = torch.where(absmax > 0, absmax / levels, torch.ones_like(absmax))
    weight_max = linear.int8_weight_max
    w_scales = (weight.abs().amax(dim=1) / weight_max).clamp_min(torch.finfo(torch.float32).tiny)
    w_q = torch.round(weight / w_scales[:, None]).clamp(-weight_max, weight_max)
    sums = (x_q.double() @ w_q.double().T).float()  # exact: |sums| < 2^24
    expected = sums * w_scales * x_scales + bias
    torch.testing.assert_close(linear(x), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(linear(x[:1]), expected[:1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("compute_type,route", [("float32", route) for route in FLOAT32_ROUTES] + [("bfloat16", None)] +
                         [("int8", route) for route in INT8_ROUTES])
def test_linear_passes_non_finite_rows_on_and_takes_empty_batches(compute_type, route):
    x, weight, bias = linear_inputs(rows=6)
    x[1, 7] = float("nan")
    x[2, 0] = float("inf")
    if compute_type == "float32":
        linear = float32_linear(weight, bias, route)
    else:
        linear = extension().PackedLinear(weight, bias, 16, compute_type, **(int8_route(route) if route else {}))
    y = linear(x)
    assert not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()
    assert torch.isfinite(y[[0, 3, 4, 5]]).all()
    assert linear(x[:0]).shape == (0, weight.shape[0])


@pytest.mark.parametrize("route", INT8_ROUTES)
def test_an_int8_row_does_not_depend_on_the_other_rows(route):
    """FBGEMM quantizes a whole input with one scale: the rows, divided by their absmax, and the two rows +1/-1
    fix it, so that a row's result is the same beside any others, large or small. fastformer's own GEMM tiles
    6 rows at a time: a row's result must not depend on its place in a tile either."""
    x, weight, bias = linear_inputs(rows=9)
    linear = extension().PackedLinear(weight, bias, 16, "int8", **int8_route(route))
    alone = torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])
    others = torch.randn(23, x.shape[1], generator=torch.Generator().manual_seed(4)) * 50.0
    assert torch.equal(linear(x), alone)
    assert torch.equal(linear(torch.cat([others, x, others / 1000]))[23:32], alone)


def test_a_bad_compute_type_is_named_with_the_valid_ones():
    x, weight, bias = linear_inputs(rows=6)
    with pytest.raises(RuntimeError, match='compute_type must be "float32", "bfloat16" or "int8", got "int4"'):
        extension().PackedLinear(weight, bias, 16, "int4")
    with pytest.raises(ValueError, match="compute_type must be one of auto, float32, float16, bfloat16, int8"):
        resolve_compute_type("fp8", CPU, torch.float32)
    with pytest.raises(ValueError, match="runs on CUDA only; on the CPU use one of float32, bfloat16, int8"):
        resolve_compute_type("float16", CPU, torch.float32)
    with pytest.raises(ValueError, match="compute_type must be one of"):
        make_model().translate(padded_sources(make_model(), [3]), compute_type="half")


def test_auto_is_int8_where_torch_has_onednn_int8_and_float32_with_a_warning_elsewhere(monkeypatch):
    import fastformer.decoding.compiled as compiled

    assert resolve_compute_type(None, CPU, torch.float32) == "float32"
    assert resolve_compute_type(None, CPU, torch.float16) == "float32"  # the CPU kernels widen float16
    assert resolve_compute_type("auto", CPU, torch.float32) == ("int8" if compiled.has_int8_linear() else "float32")
    monkeypatch.setattr(compiled, "has_int8_linear", lambda: False)
    with pytest.warns(UserWarning, match="compute_type='auto' runs float32: this torch has no oneDNN int8 linear"):
        assert resolve_compute_type("auto", CPU, torch.float32) == "float32"


def test_bfloat16_without_the_cpus_instructions_warns_how_much_slower_and_what_to_use_instead():
    """oneDNN capped to AVX2 (as a CPU without AVX512-BF16, AMX or AVX-NE-CONVERT): bfloat16 still translates, and
    the warning gives the expected slowdown and the types to use instead."""
    code = ("import warnings, torch, fastformer\n"
            "torch.manual_seed(0)\n"
            "model = fastformer.Transformer(fastformer.TransformerConfig.tiny(vocab_size=50)).eval()\n"
            "src = torch.tensor([[5, 6, 7, 2]])\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    hypothesis = model.translate(src, beam_size=2, compute_type='bfloat16')[0][0]\n"
            "print(len(hypothesis.tokens) > 0, [str(w.message) for w in caught])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent, env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True") and BFLOAT16_FALLBACK_WARNING in done.stdout
    assert "4-7x the time of float32" in BFLOAT16_FALLBACK_WARNING
    assert "use compute_type='int8'" in BFLOAT16_FALLBACK_WARNING


def test_cuda_compute_types_resolve_without_a_gpu(monkeypatch):
    """Only the choice of type on CUDA, which needs no GPU: the CUDA searches in them have not run on a GPU yet."""
    cuda = torch.device("cuda")
    assert resolve_compute_type(None, cuda, torch.float16) == "float16"
    assert resolve_compute_type("bfloat16", cuda, torch.float32) == "bfloat16"
    for bf16_supported, expected in ((True, "bfloat16"), (False, "float16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16_supported)
        assert resolve_compute_type("auto", cuda, torch.float32) == expected
    with pytest.raises(ValueError, match="'int8' runs on the CPU only; on CUDA use one of float32, float16, bfloat16"):
        resolve_compute_type("int8", cuda, torch.float32)
    with pytest.raises(ValueError, match="'float32' on CUDA needs a float32 model, this one is torch.float16"):
        resolve_compute_type("float32", cuda, torch.float16)


@pytest.mark.parametrize("norm_first,options", [(False, dict(activation="relu")), (True, dict(activation="gelu")),
                                                (False, dict(activation="swish", scale_embedding=False))])
def test_compiled_encoder_matches_model_encode(norm_first, options):
    model = make_model(norm_first, **options)
    src = padded_sources(model, [5, 2, 7, 1])
    memory, src_lengths = encode(model, src, compiled_model(model, "float32"))
    expected = model.encode(src)
    torch.testing.assert_close(src_lengths, expected.src_lengths)
    for row, length in enumerate(src_lengths.tolist()):  # positions past a source's length are never read
        torch.testing.assert_close(memory[row, :length], expected.memory[row, :length], **FP32)
        # Bitwise as the sentence alone, unpadded: the batch's padding changes none of its rows' arithmetic (an Intel
        # Xeon's build once grouped a sentence's positions with padding rows, and they rounded otherwise).
        alone, _ = encode(model, src[row:row + 1, :length], compiled_model(model, "float32"))
        assert torch.equal(alone[0], memory[row, :length]), f"sentence {row}: alone differs from its batch rows"


# Search in a compute type against oracles that score with the same converted model.

def teacher_forced_scores(model: Transformer, src: torch.Tensor, targets: list[list[int]],
                          compute_type: str) -> list[float]:
    """src: [1, src_len]; each target (real tokens, EOS appended here) -> its log-probability under the model as it
    runs in compute_type, every target a slot of one incremental decoder."""
    config = model.config
    memory, src_lengths = encode(model, src, compiled_model(model, compute_type))
    length = max(len(t) for t in targets) + 1
    rows = [[config.bos_id, *t] + [config.eos_id] * (length - 1 - len(t)) for t in targets]
    tokens = torch.tensor(rows)
    n_slots = len(targets)
    decoder = cached_decoder(model, EncoderOutput(memory, src_lengths), n_slots,
                             cache_len=length, compute_type=compute_type)
    row_slots = torch.arange(n_slots, dtype=torch.int32)
    indirection = row_slots[:, None].expand(n_slots, length).contiguous()
    totals = torch.zeros(n_slots, dtype=torch.float64)
    for step in range(length):
        log_probs = F.log_softmax(decoder.step(tokens[:, step], row_slots, indirection, step).double(), dim=-1)
        for slot, target in enumerate(targets):
            if step <= len(target):
                next_token = target[step] if step < len(target) else config.eos_id
                totals[slot] += log_probs[slot, next_token]
    return totals.tolist()


def gnmt(total: float, n_tokens: int, alpha: float) -> float:
    return total / ((5 + n_tokens) / 6) ** alpha


@pytest.mark.parametrize("compute_type,beam_size", [("int8", 32), ("int8", 40), ("bfloat16", 40)])
def test_a_large_beam_finds_the_optimum_of_the_converted_model(compute_type, beam_size):
    """3 real tokens, at most 3 of them: a beam of 32 (27 hypotheses of 3 tokens) is exhaustive. int8 rows are
    independent and their products exact integers, so the search scores as teacher forcing does (to the rounding of
    a log-softmax's sum); bfloat16 sums may round differently at another number of rows, hence its tolerance. int8
    at beam 32 takes its candidates from the output projection's summary where the own GEMM runs (2 * 32 best logits
    a row), at beam 40 from the logits."""
    model = make_model(vocab=6, eos_scale=3.0)
    src = padded_sources(model, [4])
    real = real_token_ids(model.config)
    targets = [list(t) for n in range(1, 4) for t in itertools.product(real, repeat=n)]
    scores = teacher_forced_scores(model, src, targets, compute_type)
    ranked = sorted((Hypothesis(t, gnmt(s, len(t) + 1, 0.6)) for t, s in zip(targets, scores)), key=lambda h: -h.score)
    got = model.translate(src, beam_size=beam_size, n_best=3, length_penalty=0.6, min_len=1, max_len_a=0.0, max_len_b=3,
                          compute_type=compute_type)
    atol = 1e-5 if compute_type == "int8" else 2e-2
    if compute_type == "int8":
        assert_same_hypotheses(got, [ranked[:3]], atol=atol)
    else:
        assert got[0][0].score == pytest.approx(ranked[0].score, abs=atol)


@pytest.mark.parametrize("return_scores", [True, False], ids=["scores", "argmax-only"])
@pytest.mark.parametrize("min_len", [0, 3])
def test_int8_beam_1_is_greedy_decoding(min_len, return_scores):
    """Where the own int8 GEMM runs, each step's argmax is found as the output projection makes the logits
    (PackedLinear.summarize), with EOS barred before min_len: without scores alone, with scores with the log-softmax's
    terms. The sentence's greedy translation ends before 3 tokens unless EOS is barred."""
    model = make_model(vocab=37, eos_scale=24.0)
    src = padded_sources(model, [6], seed=2)
    config = model.config
    tokens: list[int] = []
    for step in range(8):  # greedy: the argmax after the prefix, decoded step by step in int8
        memory, src_lengths = encode(model, src, compiled_model(model, "int8"))
        prefix = [config.bos_id, *tokens]
        decoder = cached_decoder(model, EncoderOutput(memory, src_lengths), 1,
                                 cache_len=len(prefix), compute_type="int8")
        indirection = torch.zeros(1, len(prefix), dtype=torch.int32)
        for step, token in enumerate(prefix):
            logits = decoder.step(torch.tensor([token]), torch.zeros(1, dtype=torch.int32), indirection, step)
        # The search never emits PAD or BOS, nor EOS before min_len.
        allowed = torch.tensor([*real_token_ids(config), *([config.eos_id] if step >= min_len else [])])
        best = int(allowed[logits[0, allowed].argmax()])
        if best == config.eos_id:
            break
        tokens.append(best)
    got = model.translate(src, beam_size=1, min_len=min_len, max_len_a=0.0, max_len_b=8, compute_type="int8",
                          return_scores=return_scores)
    assert got[0][0].tokens == tokens
    assert len(tokens) < 3 if min_len == 0 else len(tokens) >= min_len


@pytest.mark.parametrize("compute_type", ["int8", "float32"])
@pytest.mark.parametrize("topk,topp", [(10, 1.0), (5, 0.8), (64, 1.0)])
def test_sampling_without_scores_draws_as_the_one_with_scores(topk, topp, compute_type):
    """Without scores, where an own GEMM that summarizes runs (int8, AVX-512 float32), sampling's top-k is found as
    the output projection makes the logits (PackedLinear.summarize); with scores, from the logits written (the
    one-pass scan): the same candidates and uniforms, so the same samples, with EOS barred before min_len as well."""
    skip_without_float32_summary(compute_type)
    model = make_model(vocab=130, eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9, 3, 8], seed=3)
    drawn = set()
    for seed in range(4):  # n_best > 1 asks for scores: one sample a sentence and call
        search = dict(beam_size=1, max_len_a=1.0, max_len_b=5, min_len=2, compute_type=compute_type,
                      sampling_topk=topk, sampling_topp=topp, sampling_temperature=0.7, seed=seed)
        with_scores = [s[0].tokens for s in model.translate(src, return_scores=True, **search)]
        assert [s[0].tokens for s in model.translate(src, return_scores=False, **search)] == with_scores
        drawn.update(tuple(tokens) for tokens in with_scores)
    assert len(drawn) > 16


@pytest.mark.parametrize("compute_type", ["int8", "float32"])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_search_from_the_best_logits_equals_the_one_from_the_logits(beam_size, compute_type):
    """Where an own GEMM that summarizes runs (int8, AVX-512 float32), a search with scores takes each row's
    2 * beam_size best logits, its top, log-sum-exp and EOS's logit from the output projection
    (PackedLinear.summarize); with a shortlist of the whole vocabulary it reads the same logits written: the same
    hypotheses, the scores to rounding (the log-sum-exp is summed in another order), sentences finishing at different
    steps, EOS barred before min_len."""
    if compute_type == "int8":
        int8_route("own")
    skip_without_float32_summary(compute_type)
    model = make_model(vocab=37, eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9, 3, 8], seed=3)
    vocab = model.config.vocab_size
    whole = Shortlist(candidates=torch.full((vocab, 1), -1), always=torch.arange(vocab))
    search = dict(beam_size=beam_size, n_best=beam_size, max_len_a=1.0, max_len_b=5, min_len=2,
                  compute_type=compute_type)
    from_best = model.translate(src, **search)
    assert_same_hypotheses(from_best, model.translate(src, shortlist=whole, **search), atol=1e-5)
    assert len({len(h[0].tokens) for h in from_best}) > 1


@pytest.mark.parametrize("compute_type", ["int8", "float32"])
def test_scores_of_every_next_token_sum_to_one(compute_type):
    """Teacher-forced scoring of one source and prefix followed by each id of the vocabulary: the rows of that
    position are the same, so the probabilities scored there sum to 1 (the own int8 GEMM and the AVX-512 float32 one
    give each target's logit and the log-softmax's terms from the output projection's summary; elsewhere the logits
    are written)."""
    model = make_model(vocab=37, eos_scale=8.0)
    vocab = model.config.vocab_size
    src = padded_sources(model, [6], seed=2).expand(vocab, -1)
    scored = model.score(src, [[7, 5, token] for token in range(vocab)], compute_type=compute_type)
    probabilities = torch.stack([tokens[2] for tokens in scored]).double().exp()
    assert probabilities.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert probabilities.max() > 2 * probabilities.min()


def test_int8_greedy_search_without_scores_equals_the_one_with_scores_on_a_batch():
    """The argmax alone found inside the output projection (no scores) against the candidates with their
    log-softmax's terms (scores): the same logits, so the same tokens, for sentences finishing at different steps."""
    model = make_model(vocab=37, eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9, 3, 8], seed=3)
    search = dict(beam_size=1, max_len_a=1.0, max_len_b=5, compute_type="int8")
    with_scores = model.translate(src, return_scores=True, **search)
    argmax_only = model.translate(src, return_scores=False, **search)
    assert [h[0].tokens for h in argmax_only] == [h[0].tokens for h in with_scores]
    assert len({len(h[0].tokens) for h in with_scores}) > 1


@pytest.mark.parametrize("compute_type", ["int8", "float32"])
@pytest.mark.parametrize("k", [0, 1, 10, 16, 17, 64])  # 16: the most the AVX-512 tiles rank in vectors
def test_summary_equals_a_stable_sort_and_the_log_softmax_of_the_outputs(k, compute_type):
    """PackedLinear.summarize against the same layer's outputs written: its top-k against a stable descending sort
    with the barred ids at -inf (the last panel in part, ids barred in several panels, ties to the lower id: three
    equal weight rows, the highest outputs of every row); its log-softmax terms against float64's log_softmax; the
    picked outputs; finite False for the rows holding NaN or inf."""
    x, weight, bias = linear_inputs(rows=13, in_features=96, out_features=130)
    weight[41] = weight[77] = weight[40]  # equal outputs at 40 and 41 (one tile) and 77 (the next) ...
    bias[41] = bias[77] = bias[40] = 50.0  # ... and the highest in every row
    linear = summarizing_linear(weight, bias, 16, compute_type)
    outputs = linear(x)
    picked_ids = torch.arange(13) * 11 % 130
    for barred in ([], [0, 1, 2], [40, 129]):
        expected = outputs.clone()
        expected[:, barred] = -float("inf")
        expected_values, expected_ids = expected.sort(dim=1, descending=True, stable=True)
        summary = linear.summarize(x, k, barred, log_totals=True, picked_ids=picked_ids)
        assert torch.equal(summary["ids"], expected_ids[:, :k]) and torch.equal(summary["values"],
                                                                                expected_values[:, :k])
        assert summary["finite"].all()
        assert torch.equal(summary["tops"], outputs.max(1).values)
        assert torch.equal(summary["picked"], outputs.gather(1, picked_ids[:, None])[:, 0])
        log_probs = (summary["picked"] - summary["tops"]) - summary["log_totals"]
        expected_log_probs = outputs.double().log_softmax(1).gather(1, picked_ids[:, None])[:, 0]
        torch.testing.assert_close(log_probs.double(), expected_log_probs, atol=1e-5, rtol=0)
    assert linear.summarize(x, k)["tops"] is None and linear.summarize(x, k)["picked"] is None
    x[3, 5] = float("nan")
    x[8, 0] = float("inf")
    summary = linear.summarize(x, k)
    assert summary["finite"].tolist() == [i not in (3, 8) for i in range(13)]
    if k > 0:
        assert (summary["ids"][[0, 1, 2, 4, 5, 6, 7], 0] == 40).all()
    if k > 2:
        assert (summary["ids"][[0, 1, 2, 4, 5, 6, 7], 1:3] == torch.tensor([41, 77])).all()


@pytest.mark.parametrize("compute_type", ["int8", "float32"])
def test_summary_of_a_few_rows_split_across_threads_equals_the_one_of_one_thread(compute_type):
    """Fewer rows than a tile a thread (a sentence's beams): two threads split the panels and merge their parts;
    the same best and picked outputs, the same log-softmax terms to rounding."""
    x, weight, bias = linear_inputs(rows=6, in_features=96, out_features=1030)
    x = x[:4]
    linear = summarizing_linear(weight, bias, 4, compute_type)
    picked_ids = torch.tensor([0, 1029, 500, 77])
    one = linear.summarize(x, 8, [3, 900], log_totals=True, picked_ids=picked_ids)
    with threads(2):
        two = linear.summarize(x, 8, [3, 900], log_totals=True, picked_ids=picked_ids)
    for name in ("values", "ids", "finite", "tops", "picked"):
        assert torch.equal(two[name], one[name]), name
    torch.testing.assert_close(two["log_totals"], one["log_totals"], atol=1e-6, rtol=0)


def test_int8_translation_does_not_depend_on_the_batch():
    """Each row is quantized on its own and int8 products are exact: a sentence decodes the same alone or in any
    batch, and on any number of threads."""
    model = make_model(vocab=37, eos_scale=8.0)
    src = padded_sources(model, [7, 2, 5, 1, 4, 9, 3, 8], seed=3)
    search = dict(beam_size=3, n_best=2, max_len_a=1.0, max_len_b=5, compute_type="int8")
    batch = model.translate(src, **search)
    alone = [model.translate(src[i:i + 1, :int((src[i] != model.config.pad_id).sum())], **search)[0]
             for i in range(src.shape[0])]
    assert_same_hypotheses(batch, alone, atol=1e-5)
    with threads(2):
        assert_same_hypotheses(model.translate(src, **search), batch, atol=1e-5)


# Converted once, never stale.

def test_weights_are_converted_once_and_again_after_any_parameter_change():
    model = make_model(vocab=37, eos_scale=4.0)
    src = padded_sources(model, [5, 3])
    first = compiled_model(model, "int8")
    assert compiled_model(model, "int8") is first
    assert compiled_model(model, "float32") is not first

    def translations(m: Transformer) -> list:
        return m.translate(src, beam_size=2, max_len_b=6, compute_type="int8")

    before = translations(model)
    other = make_model(vocab=37, eos_scale=4.0, seed=5)
    model.load_state_dict(other.state_dict())  # in-place copies: same storage, new versions
    assert compiled_model(model, "int8") is not first
    assert_same_hypotheses(translations(model), translations(other))
    assert translations(model) != before
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model.loss(src, torch.full_like(src, 4), torch.full_like(src, 5)).backward()
    optimizer.step()
    model.eval()
    reference = copy.deepcopy(model)  # a copy starts with no converted weights
    assert reference.__dict__["_compiled_cache"].get(reference, "int8") is None
    assert_same_hypotheses(translations(model), translations(reference))


def test_edits_through_data_take_effect_after_forget_compiled():
    """p.data.copy_ leaves the version counter as it was, so the converted weights are dropped by hand."""
    model, other = make_model(vocab=37, eos_scale=4.0), make_model(vocab=37, eos_scale=4.0, seed=5)
    src = padded_sources(model, [5, 3])
    search = dict(beam_size=2, max_len_b=6, compute_type="int8")
    before = model.translate(src, **search)
    for mine, theirs in zip(model.parameters(), other.parameters()):
        mine.data.copy_(theirs)
    model.forget_compiled()
    assert_same_hypotheses(model.translate(src, **search), other.translate(src, **search))
    assert model.translate(src, **search) != before


def test_a_model_made_under_inference_mode_translates_and_scores():
    with torch.inference_mode():
        model = make_model(vocab=37, eos_scale=4.0)
    twin = make_model(vocab=37, eos_scale=4.0)
    src = padded_sources(model, [5, 3])
    assert_same_hypotheses(model.translate(src, beam_size=2, compute_type="int8"),
                           twin.translate(src, beam_size=2, compute_type="int8"))
    for mine, theirs in zip(model.score(src, [[4, 5], [6]]), twin.score(src, [[4, 5], [6]])):
        assert torch.equal(mine, theirs)


def test_a_model_with_converted_weights_still_saves_and_copies():
    model = make_model()
    compiled_model(model, "int8")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    src = padded_sources(model, [4])
    assert_same_hypotheses(loaded.translate(src, compute_type="int8"), model.translate(src, compute_type="int8"))


def test_int8_weights_take_about_a_quarter_of_float32():
    config = TransformerConfig(vocab_size=1000, d_model=256, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                               d_ff=1024, dropout=0.0)
    model = Transformer(config).eval()
    ratio = compiled_model(model, "int8").nbytes / compiled_model(model, "float32").nbytes
    assert 0.25 <= ratio < 0.3, ratio


@pytest.mark.parametrize("compute_type", ["int8", "bfloat16"])
def test_non_finite_weights_are_refused_in_every_compute_type(compute_type):
    model = make_model()
    with torch.no_grad():
        model.encoder.layers[0].ffn.linear1.weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="not finite"):
        model.translate(padded_sources(model, [4, 3]), compute_type=compute_type)
