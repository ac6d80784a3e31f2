"""fastformer: the Transformer of "Attention Is All You Need" with fused Triton kernels and a compiled beam search."""

import torch

from fastformer.torch_version import check_torch_version

check_torch_version(torch.__version__)

from fastformer import nn
from fastformer.config import TransformerConfig
from fastformer.dispatch import backend, get_backend, set_backend
from fastformer.decoding.shortlist import Shortlist, build_shortlist
from fastformer.model import EncoderOutput, Transformer
from fastformer.translation.translator import Translator, load_translator

__version__ = "0.1.0"

__all__ = ["Transformer", "TransformerConfig", "EncoderOutput", "Translator", "load_translator", "Shortlist",
           "build_shortlist", "nn", "backend", "get_backend", "set_backend"]
