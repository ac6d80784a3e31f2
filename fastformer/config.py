"""The model's hyperparameters: one dataclass, the paper's presets, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass

ACTIVATIONS = ("relu", "gelu", "swish")
POSITION_LAYOUTS = ("interleaved", "halves")


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation: str = "relu"  # "swish" is SiLU, as in Marian/OPUS-MT models
    norm_first: bool = False  # False: the paper's post-LN; True: pre-LN as in tensor2tensor
    tie_embeddings: bool = True  # source, target and output share one [vocab, d_model] matrix
    max_positions: int = 1024
    # "interleaved": sin on even channels, cos on odd ones (the paper, tensor2tensor); "halves": [sin | cos] (Marian).
    position_layout: str = "interleaved"
    scale_embedding: bool = True  # embeddings times sqrt(d_model) before the positions are added
    output_bias: bool = False  # a [vocab] bias on the output projection (Marian's final_logits_bias)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff",
                     "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        # The position table pairs each sine channel with a cosine channel.
        if self.d_model % 2:
            raise ValueError(f"d_model must be even (sinusoidal positions pair each sine with a cosine), "
                             f"got {self.d_model}")
        # A target needs a position for BOS and one for a token or EOS.
        if self.max_positions < 2:
            raise ValueError(f"max_positions must be at least 2, got {self.max_positions}")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
        for name in ("norm_first", "tie_embeddings", "scale_embedding", "output_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.position_layout not in POSITION_LAYOUTS:
            raise ValueError(f"position_layout must be one of {POSITION_LAYOUTS}, got {self.position_layout!r}")
        special = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        for name, value in special.items():
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} must be an int in [0, vocab_size={self.vocab_size}), got {value!r}")
        # Marian starts the decoder from its pad token, so bos_id may equal pad_id; EOS must differ from both.
        if self.eos_id in (self.pad_id, self.bos_id):
            raise ValueError(f"eos_id must differ from pad_id and bos_id, got {special}")
        if self.vocab_size <= len(set(special.values())):
            raise ValueError(f"vocab_size ({self.vocab_size}) must exceed the special tokens' ids {special}: a model "
                             f"that can emit only EOS translates nothing")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def base(cls, vocab_size: int, **overrides) -> TransformerConfig:
        """The paper's Table 3 base model (63.1M parameters with a 37k shared vocabulary; the paper: 65M)."""
        return cls(vocab_size=vocab_size, **overrides)

    @classmethod
    def big(cls, vocab_size: int, **overrides) -> TransformerConfig:
        """The paper's Table 3 big model (214.2M parameters with a 37k shared vocabulary; the paper: 213M)."""
        params = dict(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3)
        return cls(vocab_size=vocab_size, **{**params, **overrides})

    @classmethod
    def tiny(cls, vocab_size: int, **overrides) -> TransformerConfig:
        """A model small enough for tests and CPU training (head_dim 32, which the fused kernels support)."""
        params = dict(d_model=64, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, d_ff=128, max_positions=256)
        return cls(vocab_size=vocab_size, **{**params, **overrides})

    def to_dict(self) -> dict:
        return asdict(self)
