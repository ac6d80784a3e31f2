import math

import pytest
import torch

import fastformer
from fastformer import TransformerConfig


def parameter_count(config: TransformerConfig) -> int:
    return sum(p.numel() for p in fastformer.Transformer(config).parameters())


def test_presets_match_the_papers_table_3():
    # The paper: base ~65M, big ~213M with its 37k shared vocabulary (our count ties the three embeddings).
    assert 60e6 < parameter_count(TransformerConfig.base(37000)) < 66e6
    assert 205e6 < parameter_count(TransformerConfig.big(37000)) < 215e6
    big = TransformerConfig.big(37000)
    assert (big.d_model, big.n_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)


@pytest.mark.parametrize("overrides, message", [
    (dict(d_model=100, n_heads=3), "divisible"),
    (dict(eos_id=0), "eos_id must differ"),
    (dict(bos_id=2), "eos_id must differ"),
    (dict(eos_id=50), "eos_id"),
    (dict(dropout=1.0), "dropout"),
    (dict(activation="tanh"), "activation"),
    (dict(position_layout="rotary"), "position_layout"),
    (dict(n_encoder_layers=0), "n_encoder_layers"),
    (dict(d_model=33, n_heads=3), "d_model must be even"),
    (dict(d_model=45, n_heads=5), "d_model must be even"),
    (dict(max_positions=1), "max_positions must be at least 2"),
    (dict(dropout="0.1"), "dropout must be a float"),
    (dict(attention_dropout=None), "attention_dropout must be a float"),
    (dict(norm_first="false"), "norm_first must be a bool"),
    (dict(tie_embeddings=None), "tie_embeddings must be a bool"),
    (dict(scale_embedding=1), "scale_embedding must be a bool"),
    (dict(output_bias="yes"), "output_bias must be a bool"),
])
def test_invalid_configs_are_rejected_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig.tiny(50, **overrides)


@pytest.mark.parametrize("vocab_size, special", [(3, {}), (2, dict(pad_id=0, bos_id=0, eos_id=1))])
def test_a_vocabulary_of_special_tokens_alone_is_refused(vocab_size, special):
    with pytest.raises(ValueError, match=f"vocab_size \\({vocab_size}\\) must exceed the special tokens"):
        TransformerConfig.tiny(vocab_size, **special)
    TransformerConfig.tiny(vocab_size + 1, **special)  # one token beside them is a model


def test_backend_switch():
    assert fastformer.get_backend() == "auto"
    with fastformer.backend("reference"):
        assert fastformer.get_backend() == "reference"
    assert fastformer.get_backend() == "auto"
    with pytest.raises(ValueError, match="backend"):
        fastformer.set_backend("cuda")


def test_positions_in_halves_are_the_interleaved_table_with_channels_regrouped():
    from fastformer.model import sinusoidal_positions
    interleaved = sinusoidal_positions(16, 8)
    halves = sinusoidal_positions(16, 8, "halves")
    torch.testing.assert_close(halves, torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1))
    assert halves[3, 0].item() == pytest.approx(math.sin(3.0))
    assert halves[3, 4].item() == pytest.approx(math.cos(3.0))


def test_marian_style_model_options_change_the_forward_as_defined():
    """swish FFN, [sin | cos] positions, unscaled embeddings, an output bias, and a decoder started from pad."""
    torch.manual_seed(0)
    config = TransformerConfig.tiny(40, activation="swish", position_layout="halves", scale_embedding=False,
                                    output_bias=True, pad_id=39, bos_id=39, eos_id=0)
    model = fastformer.Transformer(config).eval()
    with torch.no_grad():
        model.output_bias.normal_()
    src = torch.tensor([[5, 6, 0, 39]])
    tgt_in = torch.tensor([[39, 7, 8]])  # starts from pad == bos
    with fastformer.backend("reference"):
        logits = model(src, tgt_in)
        hidden = model.decode_hidden(tgt_in, model.encode(src))
        embedded = model.embed(tgt_in)
    torch.testing.assert_close(logits, hidden @ model.embed_tokens.weight.T + model.output_bias)
    torch.testing.assert_close(embedded, model.embed_tokens(tgt_in) + model.positions[:3])
    assert model.decoder.layers[0].ffn.activation is torch.nn.functional.silu
    assert model.lengths(tgt_in, "tgt_in", starts_with_bos=True).tolist() == [3]
    with pytest.raises(ValueError, match="right-padded"):
        model.lengths(tgt_in, "src_tokens")
