"""The options of a training run (`fastformer train`'s flags) and which of them a resumed run must keep."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastformer.config import TransformerConfig
from fastformer.data.prepared import DEFAULT_BUNDLED_VOCAB, default_vocab_size
from fastformer.dispatch import BACKENDS

PRESETS = {"tiny": TransformerConfig.tiny, "base": TransformerConfig.base, "big": TransformerConfig.big}
BATCHINGS = ("tokens", "buckets")
PRECISIONS = ("auto", "bf16-master")
STEPS = ("eager", "captured")
BEST_METRICS = ("bleu", "loss")


def _option(default: object, help: str) -> object:
    """A TrainOptions field with the help text its command-line flag shows."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainOptions:
    out_dir: str = _option("runs/demo", "the run's directory: checkpoints (each holds the vocabulary)")
    data_dir: str | None = _option(None, "corpus directory (train.*, valid.* or newstest2013.*, or .gz); default: "
                                         "the bundled toy corpus")
    prepared_dir: str | None = _option(None, "the prepared (tokenized) corpus, made if missing or out of date; "
                                             "default: a directory under ~/.cache/fastformer/prepared")
    extra_data: list[str] | None = _option(None, "another corpus directory to train on beside --data-dir's (its "
                                                 "train.* files, e.g. back-translations); repeat it for several")
    upsample_primary: int = _option(1, "count --data-dir's corpus (or the bundled one) this many times an epoch beside "
                                       "--extra-data's")
    tag_extra: str | None = _option(None, "prepend this reserved token (e.g. '<BT>') to the sources of --extra-data's "
                                          "corpora, as tagged back-translation does: the vocabulary fastformer learns "
                                          "reserves it; --init-from's must hold it reserved")
    src_lang: str = _option("en", "source language: the files' suffix")
    tgt_lang: str = _option("de", "target language: the files' suffix")
    init_from: str | None = _option(None, "fine-tune: start from this model's weights and tokenizer(s), a fastformer "
                                          "checkpoint or an OPUS-MT (Marian) directory, with a fresh optimizer and "
                                          "schedule; its architecture replaces --preset's and --vocab-size's")
    preset: str | None = _option(None, f"model size, one of {tuple(PRESETS)}; default: base (the paper) with "
                                       f"--data-dir, tiny on the bundled corpus (with --init-from: its model's)")
    vocab_size: int | None = _option(None, f"shared BPE vocabulary size; default: 37000 (the paper) with --data-dir, "
                                           f"{DEFAULT_BUNDLED_VOCAB} on the bundled corpus")
    dropout: float | None = _option(None, "dropout; default: the preset's")
    batch_tokens: int = _option(4096, "padded tokens per micro-batch and rank (each side)")
    update_tokens: int = _option(25000, "tokens per update over all ranks, reached by gradient accumulation")
    lr_scale: float = _option(1.0, "peak learning rate factor: lr = lr_scale * d_model^-0.5 * schedule")
    warmup: int = _option(4000, "warmup updates of the inverse-square-root schedule")
    label_smoothing: float = _option(0.1, "label smoothing of the training loss")
    clip_norm: float = _option(0.0, "clip the gradients' global L2 norm to this before each update (0: no clipping)")
    max_steps: int = _option(100_000, "updates to train (in all, counting those a resumed run already did)")
    max_minutes: float = _option(0.0, "also stop after this many minutes of wall-clock time (0: no time limit)")
    log_every: int = _option(100, "updates between log lines")
    max_loss_rise: float = _option(2.0, "stop the run (diverged) when the train loss of 3 log lines in a row is more "
                                        "than this many nats above the lowest logged before them (0: never)")
    valid_every: int = _option(1000, "updates between validations (0: none)")
    valid_bleu_sentences: int = _option(200, "validation sentences translated for a BLEU score (0: none, -1: all)")
    valid_beam: int = _option(4, "beam size of the validation BLEU's translations (with translate's length penalty)")
    best_metric: str | None = _option(None, f"one of {BEST_METRICS}: the validation score that picks "
                                            f"checkpoint_best.pt and that --patience watches; default: bleu when "
                                            f"--valid-bleu-sentences is not 0, else loss")
    patience: int = _option(0, "end the run after this many validations in a row without a better --best-metric "
                               "(0: never)")
    tensorboard_logdir: str | None = _option(None, "also write the metrics (OUT_DIR/metrics.jsonl) there as "
                                                   "TensorBoard event files (needs the tensorboard extra)")
    save_every: int = _option(1000, "updates between checkpoints (0: only at the end)")
    keep_last: int = _option(5, "step checkpoints kept")
    seed: int = _option(1, "seed of the initial weights, dropout and data order")
    device: str = _option("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    backend: str = _option("auto", f"kernels, one of {BACKENDS}: auto is Triton on a GPU, plain PyTorch elsewhere")
    resume: bool = _option(False, "continue the run in --out-dir from its newest readable checkpoint")
    min_len: int = _option(3, "training pairs need at least this many tokens on each side")
    max_len: int = _option(150, "training pairs may have at most this many tokens on each side")
    max_ratio: float = _option(2.0, "training pairs may have at most this length ratio")
    batching: str = _option("tokens", f"one of {BATCHINGS}: batches of free shapes within the token budget, or of a "
                                      f"small fixed set of shapes (what --step captured needs)")
    precision: str = _option("auto", f"one of {PRECISIONS}: auto is bf16 autocast on a GPU and fp32 on the CPU; "
                                     f"bf16-master trains a bf16 copy of the model and updates fp32 master weights")
    step: str = _option("eager", f"one of {STEPS}: captured replays each bucket's step as a CUDA graph (needs a GPU, "
                                 f"--batching buckets and --precision bf16-master)")
    quiet: bool = _option(False, "no progress bar and no log lines")

    def __post_init__(self) -> None:
        if self.preset is None and self.init_from is None:
            self.preset = "tiny" if self.data_dir is None else "base"
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {self.preset!r}")
        for name, choices in (("backend", BACKENDS), ("batching", BATCHINGS), ("precision", PRECISIONS),
                              ("step", STEPS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.step == "captured" and (self.batching, self.precision) != ("buckets", "bf16-master"):
            raise ValueError("--step captured needs --batching buckets (static shapes) and --precision bf16-master "
                             "(no autocast in the graph)")
        for name in ("batch_tokens", "update_tokens", "warmup", "max_steps", "log_every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("valid_every", "save_every", "max_minutes", "patience", "clip_norm", "max_loss_rise"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self._check_validation()
        self._check_extra_data()
        if self.vocab_size is not None and self.vocab_size < 8:
            raise ValueError(f"vocab_size must be at least 8, got {self.vocab_size}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")

    def _check_extra_data(self) -> None:
        if self.upsample_primary < 1:
            raise ValueError(f"upsample_primary must be >= 1, got {self.upsample_primary}")
        if not self.extra_data and (self.upsample_primary > 1 or self.tag_extra is not None):
            raise ValueError("--upsample-primary and --tag-extra weigh and tag the corpora of --extra-data, and none "
                             "is given")
        if self.tag_extra is not None and (not self.tag_extra or any(c.isspace() for c in self.tag_extra)):
            raise ValueError(f"--tag-extra {self.tag_extra!r}: a tag is one token, without spaces")

    def _check_validation(self) -> None:
        """Resolves best_metric's default; what the best checkpoint and --patience need of validation."""
        if self.valid_bleu_sentences < -1:
            raise ValueError(f"valid_bleu_sentences must be >= -1 (-1: all), got {self.valid_bleu_sentences}")
        if self.valid_beam < 1:
            raise ValueError(f"valid_beam must be >= 1, got {self.valid_beam}")
        if self.best_metric is None:
            self.best_metric = "loss" if self.valid_bleu_sentences == 0 else "bleu"
        if self.best_metric not in BEST_METRICS:
            raise ValueError(f"best_metric must be one of {BEST_METRICS}, got {self.best_metric!r}")
        if self.best_metric == "bleu" and self.valid_bleu_sentences == 0:
            raise ValueError("--best-metric bleu needs a validation BLEU, and --valid-bleu-sentences 0 computes none: "
                             "translate some (-1: all) or use --best-metric loss")
        if self.patience and not self.valid_every:
            raise ValueError(f"--patience {self.patience} counts validations, and --valid-every 0 runs none: set "
                             f"--valid-every")


# What a resumed run must share with its checkpoint: these fix the model, the data and its order, and the update
# rule. The others (budget, logging, checkpointing, device, backend) may change from one session to the next.
RESUME_FIXED_OPTIONS = ("data_dir", "extra_data", "upsample_primary", "tag_extra", "init_from", "src_lang",
                        "tgt_lang", "preset", "vocab_size", "dropout", "batch_tokens", "update_tokens", "lr_scale",
                        "warmup", "label_smoothing", "clip_norm", "seed", "min_len", "max_len", "max_ratio",
                        "batching", "best_metric")
# Options added after checkpoints were first written: a checkpoint without one was trained with this value.
OPTIONS_ADDED_LATER = {"batching": "tokens", "clip_norm": 0.0, "init_from": None, "extra_data": None,
                       "upsample_primary": 1, "tag_extra": None}


def changed_resume_options(saved: dict, options: TrainOptions) -> list[str]:
    """The RESUME_FIXED_OPTIONS whose value differs from the saved run's, as "--flag NEW (checkpoint: OLD)"; options
    a checkpoint did not record are not compared."""
    changed = []
    saved = {**OPTIONS_ADDED_LATER, **saved}
    for name in RESUME_FIXED_OPTIONS:
        if name not in saved:
            continue
        old, new = saved[name], getattr(options, name)
        if name in ("data_dir", "init_from") and old is not None and new is not None:
            old, new = str(Path(old).resolve()), str(Path(new).resolve())
        if name == "vocab_size" and saved["init_from"] is None and options.init_from is None:
            # The default spelled out is the same vocabulary.
            old = default_vocab_size(saved.get("data_dir")) if old is None else old
            new = default_vocab_size(options.data_dir) if new is None else new
        if name == "extra_data" and old is not None and new is not None:
            old, new = [str(Path(path).resolve()) for path in old], [str(Path(path).resolve()) for path in new]
        if old != new:
            changed.append(f"--{name.replace('_', '-')} {new} (checkpoint: {old})")
    return changed
