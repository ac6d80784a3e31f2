"""fastformer: the Transformer of "Attention Is All You Need" with fused Triton kernels and a compiled beam search."""

from fastformer import nn
from fastformer.dispatch import backend, get_backend, set_backend
from fastformer.config import TransformerConfig
from fastformer.model import EncoderOutput, Transformer

__version__ = "0.1.0"

__all__ = ["Transformer", "TransformerConfig", "EncoderOutput", "nn", "backend", "get_backend", "set_backend"]
