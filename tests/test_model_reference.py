"""The model under the reference backend against a torch.nn.Transformer twin holding the same weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastformer
from fastformer import Transformer, TransformerConfig
from tolerances import FP32

VOCAB = 40


def make_model(norm_first: bool, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig.tiny(VOCAB, norm_first=norm_first, dropout=0.0, **overrides)
    return Transformer(config)


def torch_twin(model: Transformer) -> nn.Transformer:
    """A torch.nn.Transformer with the same encoder/decoder weights (embeddings and output stay in `model`)."""
    c = model.config
    layer_args = dict(d_model=c.d_model, nhead=c.n_heads, dim_feedforward=c.d_ff, dropout=0.0,
                      activation=c.activation, batch_first=True, norm_first=c.norm_first)
    final_norm = (lambda: nn.LayerNorm(c.d_model)) if c.norm_first else (lambda: None)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer_args), c.n_encoder_layers, norm=final_norm(),
                                    enable_nested_tensor=False)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer_args), c.n_decoder_layers, norm=final_norm())
    twin = nn.Transformer(c.d_model, c.n_heads, custom_encoder=encoder, custom_decoder=decoder, batch_first=True)
    state = {name.replace(".ffn.", "."): value for name, value in model.state_dict().items()
             if name.startswith(("encoder.", "decoder."))}
    twin.load_state_dict(state)
    return twin


def twin_logits(model: Transformer, twin: nn.Transformer, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    pad = model.config.pad_id
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
    hidden = twin(model.embed(src), model.embed(tgt), tgt_mask=causal, tgt_is_causal=True,
                  src_key_padding_mask=src == pad, tgt_key_padding_mask=tgt == pad,
                  memory_key_padding_mask=src == pad)
    return F.linear(hidden, model.output_weight)


def right_padded(lengths: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (len(lengths), max(lengths)), generator=generator)
    tokens[torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None]] = 0
    return tokens


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("src_lengths, tgt_lengths", [
    ([9, 4, 1], [6, 1, 3]),   # padded batches, length 1
    ([7, 1], [5, 1]),         # all but one position padded
    ([1], [1]),
])
def test_reference_model_matches_torch_transformer(norm_first, src_lengths, tgt_lengths):
    model = make_model(norm_first)
    twin = torch_twin(model)
    src, tgt = right_padded(src_lengths, 1), right_padded(tgt_lengths, 2)
    real = tgt != 0
    weight = torch.randn(*tgt.shape, VOCAB) * real[..., None]

    with fastformer.backend("reference"):
        logits = model(src, tgt)
    expected = twin_logits(model, twin, src, tgt)
    torch.testing.assert_close(logits[real], expected[real], **FP32)

    ours = dict(model.named_parameters())
    grads = dict(zip(ours, torch.autograd.grad((logits * weight).sum(), list(ours.values()), allow_unused=True)))
    # The twin shares our embedding; its encoder/decoder parameters map to ours by name.
    twin_params = {"embed_tokens.weight": model.embed_tokens.weight,
                   **{name: p for name, p in twin.named_parameters()}}
    twin_grads = dict(zip(twin_params, torch.autograd.grad((expected * weight).sum(), list(twin_params.values()))))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, twin_grads[name.replace(".ffn.", ".")], **FP32, msg=name)


def test_loss_is_label_smoothed_cross_entropy_of_the_logits():
    model = make_model(norm_first=False)
    src, tgt = right_padded([6, 3], 3), right_padded([5, 2], 4)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    with fastformer.backend("reference"):
        loss = model.loss(src, tgt_in.clone(), tgt_out, label_smoothing=0.1)
        logits = model(src, tgt_in)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=0, label_smoothing=0.1)
    torch.testing.assert_close(loss, expected, **FP32)


def test_untied_output_projection():
    model = make_model(norm_first=True, tie_embeddings=False)
    assert model.output_weight is model.output_projection.weight
    logits = model(right_padded([3], 5), right_padded([2], 6))
    assert logits.shape == (1, 2, VOCAB) and torch.isfinite(logits).all()


@pytest.mark.parametrize("make_src, error, message", [
    (lambda: torch.ones(2, 3), TypeError, "src_tokens must hold"),
    (lambda: [[1, 2]], TypeError, "src_tokens must be a torch.Tensor"),
    (lambda: torch.ones(3, dtype=torch.long), ValueError, r"shape \[batch, len\]"),
    (lambda: torch.ones(2, 0, dtype=torch.long), ValueError, r"len >= 1"),
    (lambda: torch.full((1, 3), VOCAB), ValueError, "outside"),
    (lambda: torch.ones(1, 300, dtype=torch.long), ValueError, "max_positions"),
    (lambda: torch.tensor([[5, 6], [0, 0]]), ValueError, "all padding"),
    (lambda: torch.tensor([[0, 5, 6]]), ValueError, "right-padded"),
])
def test_bad_tokens_are_rejected_by_name(make_src, error, message):
    model = make_model(norm_first=False)
    with pytest.raises(error, match=message):
        model(make_src(), torch.ones(1, 2, dtype=torch.long))


@pytest.mark.parametrize("tgt_in, tgt_out, message", [
    (torch.tensor([[1, 5], [0, 0]]), torch.tensor([[5, 2], [0, 0]]), "tgt_in has a sequence that is all padding"),
    (torch.tensor([[1, 5], [1, 0]]), torch.tensor([[5, VOCAB], [2, 0]]), "tgt_out holds ids outside"),
    (torch.tensor([[1, 5], [1, 0]]), torch.tensor([[5, -1], [2, 0]]), "tgt_out holds ids outside"),
    (torch.tensor([[1, 5], [1, 0]]), torch.tensor([[5, 2]]), "tgt_out must be a tensor of tgt_in's shape"),
    (torch.tensor([[1, 5], [1, 0]]), torch.tensor([[5, 2], [2, 7]]), "tgt_out has a real token where tgt_in is pad"),
    (torch.tensor([[1], [1]]), torch.tensor([[0], [0]]), "tgt_out is all padding"),
])
def test_loss_checks_every_batch_tensor_by_name(tgt_in, tgt_out, message):
    model = make_model(norm_first=False)
    with pytest.raises(ValueError, match=message):
        model.loss(right_padded([3, 2], 7), tgt_in, tgt_out)


def test_loss_over_all_padding_targets_sums_to_zero_and_has_no_mean():
    """reduction="mean" over zero target tokens is undefined (PyTorch: NaN) and rejected above; "sum" is an empty sum,
    and "none" is zero at every ignored position, as PyTorch gives them."""
    model = make_model(norm_first=False)
    src, tgt_in, tgt_out = right_padded([3, 2], 7), torch.tensor([[1, 5], [1, 0]]), torch.zeros(2, 2, dtype=torch.long)
    logits = model(src, tgt_in)
    for reduction in ("sum", "none"):
        expected = F.cross_entropy(logits.transpose(1, 2), tgt_out, ignore_index=0, reduction=reduction)
        with fastformer.backend("reference"):
            torch.testing.assert_close(model.loss(src, tgt_in, tgt_out, reduction=reduction), expected)
    assert F.cross_entropy(logits.transpose(1, 2), tgt_out, ignore_index=0).isnan()


def test_batch_mismatch_is_rejected():
    model = make_model(norm_first=False)
    with pytest.raises(ValueError, match="batch"):
        model(right_padded([3, 2], 7), right_padded([2], 8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_cast_there_and_back_leaves_the_model_its_state_dict_loads_into(dtype):
    """The position table is computed, not saved: a half() then float() round trip kept half's rounding in it (2e-3 in
    bfloat16), so the model differed from one loaded from its own state_dict; it is made anew at each cast."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(VOCAB, dropout=0.0)).eval()
    model.to(dtype).float()
    loaded = Transformer(model.config).eval()
    loaded.load_state_dict(model.state_dict())
    assert torch.equal(model.positions, fastformer.model.sinusoidal_positions(model.config.max_positions,
                                                                               model.config.d_model))
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])
    assert torch.equal(model.embed(src), loaded.embed(src))
    assert model.to(dtype).positions.dtype == dtype
