import pytest

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
    (dict(pad_id=5, bos_id=5), "distinct"),
    (dict(eos_id=50), "eos_id"),
    (dict(dropout=1.0), "dropout"),
    (dict(activation="swish"), "activation"),
    (dict(n_encoder_layers=0), "n_encoder_layers"),
])
def test_invalid_configs_are_rejected_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig.tiny(50, **overrides)


def test_backend_switch():
    assert fastformer.get_backend() == "auto"
    with fastformer.backend("reference"):
        assert fastformer.get_backend() == "reference"
    assert fastformer.get_backend() == "auto"
    with pytest.raises(ValueError, match="backend"):
        fastformer.set_backend("cuda")
