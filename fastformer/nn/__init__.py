"""Drop-in `torch.nn` modules whose work runs in fused kernels (chosen by `fastformer.set_backend`)."""

from fastformer.nn.attention import MultiheadAttention
from fastformer.nn.cross_entropy import LabelSmoothedCrossEntropyLoss, LinearCrossEntropyLoss
from fastformer.nn.layernorm import ResidualLayerNorm

__all__ = ["MultiheadAttention", "LabelSmoothedCrossEntropyLoss", "LinearCrossEntropyLoss", "ResidualLayerNorm"]
