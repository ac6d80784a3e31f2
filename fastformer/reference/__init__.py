"""Plain-PyTorch references of every fused piece: short, obviously correct, and the oracle for the kernels.

The reference of the whole model is `fastformer.Transformer` run under `fastformer.backend("reference")`.
"""

from fastformer.reference.attention import attention
from fastformer.reference.beam_search import Hypothesis, beam_search
from fastformer.reference.cross_entropy import cross_entropy, linear_cross_entropy
from fastformer.reference.layernorm import residual_layer_norm

__all__ = ["Hypothesis", "attention", "beam_search", "cross_entropy", "linear_cross_entropy", "residual_layer_norm"]
