"""The whole model on the Triton kernels (the interpreter on CPU) against the reference, with the same weights."""

import os
import warnings
from pathlib import Path

import pytest
import torch

import fastformer
from fastformer import Transformer, TransformerConfig, dispatch
from fastformer.dispatch import UnsupportedInputError
from tolerances import FP32

VOCAB = 37


def batch(lengths: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (len(lengths), max(lengths)), generator=generator)
    tokens[torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None]] = 0
    return tokens


def loss_and_grads(model: Transformer, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    src, tgt = batch([9, 3, 1], 1), batch([7, 1, 4], 2)
    model.zero_grad()
    with fastformer.backend(name):
        loss = model.loss(src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous(), label_smoothing=0.1)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.interpreter
@pytest.mark.parametrize("norm_first", [False, True])
def test_fused_model_matches_reference_logits_and_every_gradient(norm_first, kernel_calls):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(VOCAB, norm_first=norm_first, dropout=0.0))
    src, tgt = batch([9, 3, 1], 3), batch([6, 6, 2], 4)
    real = tgt != 0
    with fastformer.backend("triton"):
        fused_logits = model(src, tgt)
    # Encoder self-, decoder self- and cross-attention in each layer; a LayerNorm after (or before) each sublayer.
    assert set(kernel_calls) == {"flash_attention", "residual_layer_norm"}
    forward_calls = kernel_calls.copy()
    with fastformer.backend("reference"):
        reference_logits = model(src, tgt)
    assert kernel_calls == forward_calls
    torch.testing.assert_close(fused_logits[real], reference_logits[real], **FP32)

    fused_loss, fused_grads = loss_and_grads(model, "triton")
    assert kernel_calls["linear_cross_entropy"] == 1
    assert kernel_calls["flash_attention"] == 2 * forward_calls["flash_attention"]
    reference_loss, reference_grads = loss_and_grads(model, "reference")
    assert kernel_calls["linear_cross_entropy"] == 1
    torch.testing.assert_close(fused_loss, reference_loss, **FP32)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, **FP32, msg=name)


@pytest.mark.interpreter
def test_fused_model_runs_marian_style_options_like_the_reference(kernel_calls):
    """swish, [sin | cos] positions, unscaled embeddings, an output bias (through the fused linear + CE) and a
    decoder started from pad == bos: the Triton path equals the reference, loss and every gradient."""
    torch.manual_seed(1)
    config = TransformerConfig.tiny(VOCAB, dropout=0.0, activation="swish", position_layout="halves",
                                    scale_embedding=False, output_bias=True, tie_embeddings=False,
                                    pad_id=0, bos_id=0, eos_id=1)
    model = Transformer(config)
    with torch.no_grad():
        model.output_bias.normal_()
    src, tgt = batch([9, 3, 1], 7), batch([7, 2, 4], 8)
    tgt[:, 0] = config.bos_id
    results = {}
    for name in ("triton", "reference"):
        model.zero_grad()
        with fastformer.backend(name):
            loss = model.loss(src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous(), label_smoothing=0.1)
        loss.backward()
        results[name] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert kernel_calls["linear_cross_entropy"] == 1
    torch.testing.assert_close(results["triton"][0], results["reference"][0], **FP32)
    assert results["reference"][1]["output_bias"].abs().sum() > 0
    for name, grad in results["reference"][1].items():
        torch.testing.assert_close(results["triton"][1][name], grad, **FP32, msg=name)


def training_model(seed: int) -> Transformer:
    """A tiny model in training mode with every dropout on: residual, attention, embedding."""
    torch.manual_seed(seed)
    return Transformer(TransformerConfig.tiny(VOCAB, dropout=0.2, attention_dropout=0.2)).train()


@pytest.mark.interpreter
def test_fused_training_step_checks_its_batch_with_one_host_sync(monkeypatch):
    """The batch is checked once, in Transformer.loss; the kernels' own syncing checks (attention lengths, class ids)
    never run, and torch.compile sees exactly one graph break (that check), so the rest of the step is one graph."""
    def no_check(*args):
        raise AssertionError("a kernel checked values the model had already checked")

    monkeypatch.setattr("triton_kernels.attention.check_length_values", no_check)
    monkeypatch.setattr("triton_kernels.cross_entropy._check_class_ids", no_check)
    model = training_model(2)
    src, tgt = batch([5, 2, 4], 5), batch([4, 3, 1], 6)
    with fastformer.backend("triton"):
        model.loss(src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()).backward()
        explanation = torch._dynamo.explain(model.loss)(src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous())
    assert explanation.graph_break_count == 1, [reason.reason for reason in explanation.break_reasons]
    assert explanation.break_reasons[0].user_stack[-1].name == "_checked_lengths"


@pytest.mark.interpreter
def test_fused_training_step_under_torch_compile_matches_eager():
    """With dropout on: the seeds are drawn on the device inside the graph, so eager and compiled draw the same."""
    src, tgt = batch([5, 2, 4], 5), batch([4, 3, 1], 6)
    tgt_in, tgt_out = tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()
    results = []
    for compile_step in (False, True):
        model = training_model(1)
        loss_fn = torch.compile(model.loss, backend="aot_eager") if compile_step else model.loss
        with fastformer.backend("triton"):
            torch.manual_seed(7)
            loss = loss_fn(src, tgt_in, tgt_out, label_smoothing=0.1)
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, **FP32)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, **FP32, msg=name)


def test_triton_backend_on_cpu_without_the_interpreter_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # unset already on a GPU machine
    model = Transformer(TransformerConfig.tiny(VOCAB))
    with fastformer.backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        model(batch([3], 7), batch([2], 8))


def test_triton_backend_on_cpu_names_an_interpreter_that_cannot_run_the_kernels(monkeypatch):
    """Triton 3.6's interpreter fails inside the kernels under NumPy 2.4 (the GPU machine's pair): named up front."""
    import numpy
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    model = Transformer(TransformerConfig.tiny(VOCAB))
    with fastformer.backend("triton"), pytest.raises(RuntimeError, match="Triton 3.6.0's interpreter .* NumPy 2.4.0"):
        model(batch([3], 7), batch([2], 8))
    for triton_version, numpy_version in (("3.6.0", "2.3.5"), ("3.7.0", "2.4.0"), ("3.9.0", "2.4.6")):
        monkeypatch.setattr(triton, "__version__", triton_version)
        monkeypatch.setattr(numpy, "__version__", numpy_version)
        dispatch._check_interpreter("attention")


def wmt_like_batch(batch_size: int, max_len: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, max_len + 1, (batch_size,), generator=generator)
    tokens = torch.randint(3, vocab, (batch_size, max_len), generator=generator)
    tokens[torch.arange(max_len)[None, :] >= lengths[:, None]] = 0
    return tokens.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["base", "big"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_model_low_precision_on_gpu(preset, dtype):
    from tolerances import assert_close_lowp

    torch.manual_seed(0)
    vocab = 37000
    config = getattr(TransformerConfig, preset)(vocab, dropout=0.0)
    model = Transformer(config).cuda()
    src, tgt = wmt_like_batch(16, 64, vocab, 1, "cuda"), wmt_like_batch(16, 64, vocab, 2, "cuda")
    real = tgt != 0
    with torch.no_grad(), fastformer.backend("reference"):
        exact = model(src, tgt)[real]
        with torch.autocast("cuda", dtype=dtype):
            lowp_reference = model(src, tgt)[real]
    with torch.no_grad(), fastformer.backend("triton"), torch.autocast("cuda", dtype=dtype):
        fused = model(src, tgt)[real]
    assert_close_lowp(fused.float(), lowp_reference.float(), exact, name=f"{preset} {dtype} logits")

    def loss(name: str) -> torch.Tensor:
        with fastformer.backend(name), torch.autocast("cuda", dtype=dtype):
            return model.loss(src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous(), label_smoothing=0.1)

    fused_loss, reference_loss = loss("triton"), loss("reference")
    assert abs(fused_loss.item() - reference_loss.item()) < 1e-2 * reference_loss.item()


@pytest.mark.interpreter
def test_unsupported_input_under_triton_raises_naming_it(kernel_calls):
    # head_dim 48 is not one the attention kernel takes: "triton" promises the kernel, so it must refuse, not fall back.
    attention = fastformer.nn.MultiheadAttention(96, 2, batch_first=True)
    x = torch.randn(2, 5, 96)
    with fastformer.backend("triton"), pytest.raises(UnsupportedInputError, match="attention kernel.*head_dim is 48"):
        attention(x, x, x)
    assert not kernel_calls


def test_unsupported_input_under_auto_falls_back_to_the_reference_with_one_warning(monkeypatch, kernel_calls):
    # "auto" runs Triton on CUDA tensors only; let it take these CPU tensors (the interpreter runs them) as if on CUDA.
    monkeypatch.setattr(dispatch, "_auto_runs_triton", lambda tensor: True)
    torch.manual_seed(2)
    attention = fastformer.nn.MultiheadAttention(96, 2, batch_first=True)
    x = torch.randn(2, 5, 96)
    lengths = torch.tensor([5, 3])
    with fastformer.backend("reference"):
        expected = attention(x, x, x, query_lengths=lengths, key_lengths=lengths)[0]
    with warnings.catch_warnings(record=True) as caught, fastformer.backend("auto"):
        warnings.simplefilter("default")
        outputs = [attention(x, x, x, query_lengths=lengths, key_lengths=lengths)[0] for _ in range(2)]
    fallbacks = [w for w in caught if "attention falls back to the reference" in str(w.message)]
    assert len(fallbacks) == 1 and "head_dim is 48" in str(fallbacks[0].message)
    assert not kernel_calls
    for out in outputs:
        torch.testing.assert_close(out, expected, **FP32)


@pytest.mark.interpreter
def test_auto_runs_the_kernels_it_takes_without_a_warning(monkeypatch, kernel_calls):
    monkeypatch.setattr(dispatch, "_auto_runs_triton", lambda tensor: True)
    attention = fastformer.nn.MultiheadAttention(64, 2, batch_first=True)
    x = torch.randn(2, 5, 64)
    with warnings.catch_warnings(), fastformer.backend("auto"):
        warnings.simplefilter("error")
        attention(x, x, x)
    assert kernel_calls == {"flash_attention": 1}


def test_gpu_marker_skips_without_cuda_and_runs_with_it(pytester, monkeypatch):
    """conftest.py alone turns the `gpu` marker into a skip when there is no CUDA device, and only then."""
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile("""
        import pytest

        @pytest.mark.gpu
        def test_marked():
            assert False, "ran"

        def test_unmarked():
            pass
    """)
    # The inner runs execute conftest.py in this process, which without CUDA sets TRITON_INTERPRET=1; on a GPU machine
    # every later subprocess of this worker (the demo's training) would then run Triton interpreted. monkeypatch puts
    # the variable back as it was after the test.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    for cuda_available in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
        outcome = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider").parseoutcomes()
        assert outcome == ({"passed": 1, "skipped": 1} if not cuda_available else {"passed": 1, "failed": 1})
