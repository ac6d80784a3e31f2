"""--init-from: fine-tuning starts from a pretrained model, a fastformer checkpoint or an OPUS-MT (Marian)
directory. The run takes its weights and its tokenizer(s), and its architecture: --preset and --vocab-size yield to
it, and given explicitly they must agree with it. The optimizer and the schedule start afresh."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fastformer.config import TransformerConfig
from fastformer.data.tokenizer import Tokenizers
from fastformer.training.options import PRESETS, TrainOptions
from fastformer.translation import marian
from fastformer.translation.translator import load_checkpoint_tokenizers

# What a preset fixes of the network; the rest of a preset's config (dropout, activation, ...) is the model's own.
ARCHITECTURE_FIELDS = ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff")


@dataclass(frozen=True)
class InitialModel:
    path: Path
    config: TransformerConfig
    weights: dict[str, torch.Tensor]  # its state_dict
    tokenizers: Tokenizers


def load_initial_model(path: str) -> InitialModel:
    """--init-from's model, read and checked: a path that is neither a checkpoint nor a Marian directory, or one that
    does not read as one, is an error naming it."""
    source = Path(path)
    try:
        if source.is_dir():
            model, _, _ = marian.load_marian(source)
            tokenizers = marian.marian_tokenizers(source)
        elif source.is_file():
            model, tokenizers = load_checkpoint_tokenizers(source)
        else:
            raise FileNotFoundError(f"{source} does not exist")
    except (ValueError, OSError) as error:
        raise ValueError(f"--init-from {source} is neither a fastformer checkpoint nor a Marian (OPUS-MT) directory "
                         f"fastformer reads: {error}") from None
    model_ids = {name: getattr(model.config, name) for name in tokenizers.special_ids}
    if model_ids != tokenizers.special_ids:
        raise ValueError(f"--init-from {source}: the model's special ids {model_ids} are not its tokenizers' "
                         f"{tokenizers.special_ids} (a Marian decoder starts from <pad>)")
    return InitialModel(source, model.config, model.state_dict(), tokenizers)


def check_architecture(options: TrainOptions, initial: InitialModel) -> None:
    """--preset and --vocab-size, where given, must be the initial model's: else an error naming both values."""
    config = initial.config
    if options.vocab_size is not None and options.vocab_size != config.vocab_size:
        raise ValueError(f"--vocab-size {options.vocab_size} contradicts --init-from {initial.path}, whose vocabulary "
                         f"has {config.vocab_size} ids: leave --vocab-size out")
    if options.preset is not None:
        preset = PRESETS[options.preset](config.vocab_size)
        differing = [name for name in ARCHITECTURE_FIELDS if getattr(preset, name) != getattr(config, name)]
        if differing:
            raise ValueError(f"--preset {options.preset} ({_fields(preset, differing)}) contradicts the model of "
                             f"--init-from {initial.path} ({_fields(config, differing)}): leave --preset out")


def _fields(config: TransformerConfig, names: list[str]) -> str:
    return ", ".join(f"{name} {getattr(config, name)}" for name in names)
