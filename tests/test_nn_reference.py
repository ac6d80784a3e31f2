"""The nn modules under the reference backend against PyTorch's own modules: values and gradients, fp32."""

import sys

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer.nn import LabelSmoothedCrossEntropyLoss, MultiheadAttention, ResidualLayerNorm
from triton_kernels import inputs
from tolerances import FP32


@pytest.fixture(autouse=True)
def reference_backend():
    with fastformer.backend("reference"):
        yield


def padding_mask(lengths: list[int], max_len: int) -> torch.Tensor:
    return torch.arange(max_len)[None, :] >= torch.tensor(lengths)[:, None]


def attention_pair(embed_dim: int = 16, heads: int = 2):
    ours = MultiheadAttention(embed_dim, heads, batch_first=True)
    theirs = torch.nn.MultiheadAttention(embed_dim, heads, batch_first=True)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def assert_same_values_and_grads(ours_out, theirs_out, ours_inputs, theirs_inputs, keep=None):
    keep = torch.ones_like(ours_out, dtype=torch.bool) if keep is None else keep
    torch.testing.assert_close(ours_out[keep], theirs_out[keep], **FP32)
    weight = torch.randn_like(ours_out) * keep
    grads = torch.autograd.grad((ours_out * weight).sum(), ours_inputs)
    expected = torch.autograd.grad((theirs_out * weight).sum(), theirs_inputs)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, **FP32)


@pytest.mark.parametrize("lengths", [[7, 7], [7, 3], [1, 7], [7, 1]])
def test_self_attention_with_padding_matches_torch(lengths):
    torch.manual_seed(0)
    ours, theirs = attention_pair()
    x = torch.randn(2, 7, 16, requires_grad=True)
    mask = padding_mask(lengths, 7)
    out = ours(x, x, x, key_padding_mask=mask)[0]
    expected = theirs(x, x, x, key_padding_mask=mask, need_weights=False)[0]
    params = list(ours.parameters())
    assert_same_values_and_grads(out, expected, [x, *params], [x, *theirs.parameters()])


def test_default_layout_is_torchs():
    """The same constructor call as torch's, with its state_dict, reads [len, batch, embed_dim] as torch's does."""
    torch.manual_seed(3)
    ours, theirs = MultiheadAttention(16, 2), torch.nn.MultiheadAttention(16, 2)
    ours.load_state_dict(theirs.state_dict())
    query, memory = torch.randn(4, 3, 16), torch.randn(6, 3, 16)
    torch.testing.assert_close(ours(query, memory, memory)[0], theirs(query, memory, memory, need_weights=False)[0],
                               **FP32)


@pytest.mark.parametrize("lengths, error", [
    (dict(key_lengths=torch.tensor([9, 7])), r"k_lengths must lie in \[1, 7\]"),
    (dict(key_lengths=torch.tensor([0, 7])), "k_lengths has a 0"),
    (dict(key_lengths=torch.tensor([7])), "k_lengths must have shape"),
    (dict(key_lengths=torch.tensor([7.0, 7.0])), "k_lengths must have dtype"),
    (dict(query_lengths=torch.tensor([-2, 5])), r"q_lengths must lie in \[0, 5\]"),
])
def test_lengths_are_checked_under_the_reference_as_under_the_kernel(lengths, error):
    attention = MultiheadAttention(16, 2, batch_first=True)
    query, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    with pytest.raises((ValueError, TypeError), match=error):
        attention(query, memory, memory, **lengths)


def test_the_reference_and_its_checks_need_no_triton(monkeypatch):
    """The kernels' input checks run under the reference too, from a module that does not import Triton."""
    monkeypatch.setitem(sys.modules, "triton", None)  # any `import triton` now raises ImportError
    for name in [name for name in sys.modules if name.startswith("triton_kernels.") and name != inputs.__name__]:
        monkeypatch.delitem(sys.modules, name)
    attention = MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    lengths = torch.tensor([5, 3])
    out = attention(x, x, x, key_padding_mask=padding_mask([5, 3], 5))[0]
    torch.testing.assert_close(out, attention(x, x, x, key_lengths=lengths)[0], **FP32)
    with pytest.raises(ValueError, match=r"k_lengths must lie in \[1, 5\]"):
        attention(x, x, x, key_lengths=torch.tensor([6, 3]))


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_projects_packed_qkv_in_either_layout(monkeypatch, batch_first):
    forms = []
    attend = fastformer.dispatch.attention

    def recording(q, k=None, v=None, **kwargs):
        forms.append("qkv" if k is None else ("q, kv" if v is None else "q, k, v"))
        return attend(q, k, v, **kwargs)

    monkeypatch.setattr(fastformer.dispatch, "attention", recording)
    attention = MultiheadAttention(16, 2, batch_first=batch_first)
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    if not batch_first:
        x, memory = x.transpose(0, 1), memory.transpose(0, 1)
    attention(x, x, x)
    attention(x, memory, memory)
    attention(x, memory, memory.clone())
    assert forms == ["qkv", "q, kv", "q, k, v"]


def test_positional_arguments_are_torchs():
    """The 7th positional argument is average_attn_weights, as in torch: is_causal is the 8th."""
    torch.manual_seed(4)
    ours, theirs = attention_pair()
    x = torch.randn(2, 5, 16)
    expected = theirs(x, x, x, None, False, None, True)[0]
    torch.testing.assert_close(ours(x, x, x, None, False, None, True)[0], expected, **FP32)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    torch.testing.assert_close(ours(x, x, x, None, False, causal, True, True)[0],
                               theirs(x, x, x, None, False, causal, True, True)[0], **FP32)


def test_cross_attention_with_left_padding_and_float_mask_matches_torch():
    torch.manual_seed(1)
    ours, theirs = attention_pair()
    query, memory = torch.randn(3, 4, 16, requires_grad=True), torch.randn(3, 9, 16, requires_grad=True)
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[1, :5] = True  # left padding: not a suffix, so it takes the general mask path
    mask[2, 8:] = True
    float_mask = torch.randn(4, 9)
    out = ours(query, memory, memory, key_padding_mask=mask, attn_mask=float_mask)[0]
    expected = theirs(query, memory, memory, key_padding_mask=mask, attn_mask=float_mask, need_weights=False)[0]
    assert_same_values_and_grads(out, expected, [query, memory], [query, memory])


def test_causal_attention_length_one_and_batch_second_match_torch():
    torch.manual_seed(2)
    ours, theirs = attention_pair()
    ours.batch_first = theirs.batch_first = False
    for length in (1, 6):
        x = torch.randn(length, 2, 16, requires_grad=True)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(length)
        out = ours(x, x, x, is_causal=True)[0]
        expected = theirs(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
        assert_same_values_and_grads(out, expected, [x], [x])


def test_query_lengths_zero_padded_rows():
    torch.manual_seed(3)
    ours, _ = attention_pair()
    ours.out_proj.bias.data.zero_()
    x = torch.randn(2, 5, 16)
    lengths = torch.tensor([5, 2])
    out = ours(x, x, x, query_lengths=lengths, key_lengths=lengths)[0]
    assert torch.equal(out[1, 2:], torch.zeros(3, 16))
    masked = ours(x, x, x, key_padding_mask=padding_mask([5, 2], 5))[0]
    torch.testing.assert_close(out[1, :2], masked[1, :2], **FP32)


def test_attention_bad_input():
    ours, _ = attention_pair()
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="need_weights"):
        ours(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="every key"):
        ours(x, x, x, key_padding_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"must be batched, \[batch, len, embed_dim\]: got shapes \(3, 16\)"):
        ours(x[0], x[0], x[0])


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch(label_smoothing, reduction):
    torch.manual_seed(4)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    target = torch.randint(0, 11, (3, 5))
    target[0, 2:] = -100
    loss = LabelSmoothedCrossEntropyLoss(label_smoothing=label_smoothing, reduction=reduction)(logits, target)
    expected = torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing, reduction=reduction)(
        logits.reshape(-1, 11), target.reshape(-1)).reshape(loss.shape)
    assert_same_values_and_grads(loss, expected, [logits], [logits])


def test_cross_entropy_all_ignored_is_zero_not_nan():
    logits = torch.randn(4, 7, requires_grad=True)
    loss = LabelSmoothedCrossEntropyLoss(ignore_index=0, label_smoothing=0.1)(logits, torch.zeros(4, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    with pytest.raises(ValueError, match="target"):
        LabelSmoothedCrossEntropyLoss()(logits, torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("with_residual", [True, False])
def test_residual_layer_norm_matches_torch(with_residual):
    torch.manual_seed(5)
    ours = ResidualLayerNorm(24)
    theirs = torch.nn.LayerNorm(24)
    ours.weight.data.normal_()
    ours.bias.data.normal_()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 4, 24, requires_grad=True)
    residual = torch.randn(3, 4, 24, requires_grad=True)
    if with_residual:
        y, total = ours(x, residual, return_sum=True)
        torch.testing.assert_close(total, x + residual, **FP32)
        expected = theirs(x + residual)
        inputs = [x, residual, ours.weight, ours.bias]
    else:
        y, expected = ours(x), theirs(x)
        inputs = [x, ours.weight, ours.bias]
    assert_same_values_and_grads(y, expected, inputs, [x, residual, theirs.weight, theirs.bias][: len(inputs)]
                                 if with_residual else [x, theirs.weight, theirs.bias])


@pytest.mark.parametrize("normalized_shape", [16, (16,), [16], torch.Size([16])])
def test_residual_layer_norm_takes_torchs_shape_forms(normalized_shape):
    norm, theirs = ResidualLayerNorm(normalized_shape), torch.nn.LayerNorm(normalized_shape)
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), theirs(x), **FP32)


BAD_INPUTS = {
    "int32 q": (lambda: fastformer.dispatch.attention(*[torch.ones(1, 3, 2, 8, dtype=torch.int32)] * 3),
                "q must be a floating-point tensor"),
    "3-D q": (lambda: fastformer.dispatch.attention(*[torch.randn(1, 3, 8)] * 3), "q must be 4-D"),
    "no key": (lambda: fastformer.dispatch.attention(torch.randn(1, 3, 2, 8), *[torch.randn(1, 0, 2, 8)] * 2),
               "k_len 0"),
    "k of another dtype": (lambda: fastformer.dispatch.attention(torch.randn(1, 3, 2, 8),
                                                                 torch.randn(1, 3, 2, 8).double(),
                                                                 torch.randn(1, 3, 2, 8)), "k has dtype"),
    "int32 x": (lambda: fastformer.dispatch.residual_layer_norm(torch.ones(2, 4, dtype=torch.int32), None,
                                                                torch.ones(4), torch.zeros(4)),
                "x must be a floating-point tensor"),
    "0-d x": (lambda: fastformer.dispatch.residual_layer_norm(torch.tensor(1.0), None, torch.ones(4), torch.zeros(4)),
              "non-empty last dimension"),
    "negative eps": (lambda: fastformer.dispatch.residual_layer_norm(torch.randn(2, 4), None, torch.ones(4),
                                                                     torch.zeros(4), eps=-1.0), "eps must be positive"),
    "0-d x to the module": (lambda: ResidualLayerNorm(4)(torch.tensor(1.0)), r"x must be \[\.\.\., 4\]"),
    "int64 logits": (lambda: fastformer.dispatch.cross_entropy(torch.ones(2, 4, dtype=torch.int64),
                                                               torch.zeros(2).long()),
                     "logits must be a floating-point tensor"),
    "3-D hidden": (lambda: fastformer.dispatch.linear_cross_entropy(torch.randn(2, 3, 4), torch.randn(5, 4),
                                                                    torch.zeros(2).long()), "hidden must be"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_the_reference_refuses_what_the_kernels_refuse(case):
    """On the CPU the default backend runs the reference: it refuses malformed inputs with the kernels' messages."""
    call, message = BAD_INPUTS[case]
    for backend in ("auto", "reference"):
        with fastformer.backend(backend), pytest.raises((TypeError, ValueError), match=message):
            call()


def test_residual_layer_norm_dropout_only_in_training():
    torch.manual_seed(6)
    norm = ResidualLayerNorm(32, dropout=0.5)
    x, residual = torch.randn(64, 32), torch.randn(64, 32)
    _, total = norm(x, residual, return_sum=True)
    dropped = (total - residual) == 0
    assert 0.4 < dropped.float().mean().item() < 0.6
    torch.testing.assert_close(total[~dropped], (residual + 2 * x)[~dropped], **FP32)
    norm.eval()
    torch.testing.assert_close(norm(x, residual), F.layer_norm(x + residual, (32,)), **FP32)
