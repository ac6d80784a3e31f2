"""Training as the paper: Adam with the inverse-square-root warmup schedule, label smoothing, token-budget batches
reached by gradient accumulation, data parallelism over torch.distributed, and checkpoints that resume exactly.

One process works without torchrun; under `torchrun --nproc_per_node=N` every process trains one shard (nccl on GPU,
gloo on CPU).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from fastformer import checkpoint, dispatch
from fastformer.config import TransformerConfig
from fastformer.data import Batch, BucketBatch, BucketBatchSampler, TokenBatchSampler, TokenizedCorpus
from fastformer.data.batching import mixed_corpus
from fastformer.data.reading import count_lines
from fastformer.data.prepared import PreparedCorpus
from fastformer.data.tokenizer import Tokenizers
from fastformer.decoding.compiled import extension
from fastformer.model import Transformer
from fastformer.training import gradients, run_control
from fastformer.training.captured_step import CapturedStep
from fastformer.training.early_stopping import BestTracker
from fastformer.training.init_from import InitialModel, check_architecture, load_initial_model
from fastformer.training.metrics import MetricsLog, summary_writer_class
from fastformer.training.mixed_precision import MasterWeights
from fastformer.training.options import PRESETS, TrainOptions, changed_resume_options
from fastformer.training.run_corpus import corpus_files, extra_corpus_files, open_run_corpora
from fastformer.translation import evaluate
from fastformer.translation.translator import Translator

# Validation translates this many sentences at a time, looking for a stop signal in between.
VALID_CHUNK_SENTENCES = 32


@dataclass
class TrainResult:
    step: int
    checkpoint: Path
    tokens_per_second: float  # target tokens (non-padding) per second over all ranks
    train_loss: float
    valid: dict = field(default_factory=dict)
    stopped_by: str | None = None  # what stopped the run before max_steps: a signal's name
    best: checkpoint.BestScore | None = None  # the best validation score, the step of checkpoint_best.pt
    out_of_patience: bool = False  # --patience ended the run: that many validations without a better score


def inverse_sqrt_schedule(optimizer: torch.optim.Optimizer, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The paper's schedule: the optimizer's lr (scale * d_model^-0.5) times min(step^-0.5, step * warmup^-1.5), with
    optimizer steps counted from 1; call scheduler.step() after each optimizer.step()."""
    def factor(index: int) -> float:
        step = index + 1
        return min(step ** -0.5, step * warmup ** -1.5)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _LossModule(nn.Module):
    """DistributedDataParallel synchronizes through forward(), so the summed loss is this wrapper's forward."""

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, src_lengths: torch.Tensor,
                tgt_lengths: torch.Tensor) -> torch.Tensor:
        """src: [batch, src_len], tgt_in/tgt_out: [batch, tgt_len], lengths [batch] checked on the CPU (Batch) ->
        summed label-smoothed loss: []."""
        return self.model.loss(src, tgt_in, tgt_out, label_smoothing=self.label_smoothing, reduction="sum",
                               lengths=(src_lengths, tgt_lengths))


def captured_training(model: Transformer, label_smoothing: float, lr: float, device: torch.device,
                      clip_norm: float = 0.0) -> CapturedStep:
    """`--step captured` of an fp32 model on a CUDA device: its bf16 compute copy (MasterWeights), the copy's summed
    label-smoothed loss, Adam on the fp32 masters with its lr and step count on the GPU (updated in place, as a graph
    replays them), and the CapturedStep of these (its .master, .loss_module, .optimizer), clipping the master
    gradients' norm to clip_norm (0: not)."""
    master = MasterWeights(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(lr, device=device), betas=(0.9, 0.98), eps=1e-9,
                                 fused=True, capturable=True)
    return CapturedStep(master, _LossModule(master.compute, label_smoothing), optimizer, device, clip_norm)


def process_rank() -> int:
    """This process's rank: torchrun's RANK (readable before and after the process group is joined), 0 alone."""
    return int(os.environ.get("RANK", "0"))


@dataclass
class _Distributed:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, value: object) -> list[object]:
        if self.world_size == 1:
            return [value]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered


def _setup_distributed(device_option: str) -> _Distributed:
    """Joins the torchrun process group when launched by torchrun; a lone process needs none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = evaluate.resolve_device(device_option, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return _Distributed(process_rank(), world_size, device)


def check_backend(backend: str, device: torch.device) -> None:
    """Triton kernels on CPU tensors run only in Triton's interpreter, which must be chosen before they are imported:
    say so before any work rather than at the first kernel call."""
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"--backend triton on {device} needs a GPU (--device cuda) or Triton's interpreter (set "
                         f"TRITON_INTERPRET=1 before starting fastformer); or use --backend auto or reference")


def check_step(step: str, device: torch.device) -> None:
    if step == "captured" and device.type != "cuda":
        raise ValueError(f"--step captured replays CUDA graphs: it needs a GPU (--device cuda), not {device}; or use "
                         f"--step eager")


@dataclass
class CheckedRun:
    """The options passed check_run; --init-from's model, loaded and checked (None without --init-from)."""

    initial: InitialModel | None


def check_run(options: TrainOptions) -> CheckedRun:
    """What can be checked before any work (before the out-dir is made or locked, and before --overwrite deletes
    anything): the out-dir, and a checkpoint in it to --resume from; the compiled extension where validation
    translates; the device, the backend on it, the corpus files, the tensorboard package where --tensorboard-logdir
    asks for it, and --init-from's model against the options."""
    if Path(options.out_dir).exists() and not Path(options.out_dir).is_dir():
        raise NotADirectoryError(f"--out-dir {options.out_dir} is a file, not a directory")
    if options.resume and not checkpoint.list_checkpoints(Path(options.out_dir)):
        raise FileNotFoundError(f"--resume: no checkpoint_*.pt in {options.out_dir}"
                                + ("" if Path(options.out_dir).is_dir() else " (no such directory)"))
    if options.valid_every and options.valid_bleu_sentences:
        extension()  # validation translates: without the compiled search, fail now, not at the first validation
    device = evaluate.resolve_device(options.device)
    check_backend(options.backend, device)
    check_step(options.step, device)
    files = corpus_files(options)
    if options.valid_every and count_lines(files["valid"].src) == 0:
        raise ValueError(f"the validation split ({files['valid'].src}, {files['valid'].tgt}) has no sentence pairs: "
                         "--valid-every needs some, or pass --valid-every 0 to train without validation")
    extra_corpus_files(options)
    if options.tensorboard_logdir is not None:
        summary_writer_class()
    initial = None if options.init_from is None else load_initial_model(options.init_from)
    if initial is not None:
        check_architecture(options, initial)
        if options.tag_extra is not None:
            tag_id(options, initial.tokenizers)
    _check_max_len(options, initial)
    return CheckedRun(initial)


def _check_max_len(options: TrainOptions, initial: InitialModel | None) -> None:
    """--max-len tokens and their BOS/EOS (and --tag-extra's tag) within the model's positions, before any corpus
    is prepared."""
    if initial is not None:
        max_positions, origin = initial.config.max_positions, f"--init-from {initial.path}'s model"
    else:
        max_positions, origin = PRESETS[options.preset](vocab_size=8).max_positions, f"the {options.preset} preset"
    longest = options.max_len + 1 + (options.tag_extra is not None)  # a source holds EOS, and the tag
    if longest > max_positions:
        raise ValueError(f"max_len={options.max_len} tokens plus BOS/EOS (and a tag) exceed {origin}'s "
                         f"max_positions={max_positions}: lower --max-len")


def tag_id(options: TrainOptions, tokenizers: Tokenizers) -> int:
    """The id of --tag-extra's token: a reserved piece of the run's vocabulary (the one it learned reserves it)."""
    origin = "the run's vocabulary" if options.init_from is None else f"--init-from {options.init_from}"
    try:
        return tokenizers.reserved_id(options.tag_extra, origin)
    except ValueError as error:
        raise ValueError(f"--tag-extra {error}") from None


def _load_resumable(options: TrainOptions, env: _Distributed) -> tuple[Path, checkpoint.Checkpoint]:
    """--resume: the newest readable checkpoint in out_dir, on the CPU (RNG states must be), with what it lacks or
    what this run changed refused by name. A corrupt newer file (a crash mid-write) is skipped, with a message."""
    try:
        path, saved, skipped = checkpoint.load_newest_readable(Path(options.out_dir))
    except FileNotFoundError as error:
        raise FileNotFoundError(f"--resume: {error}") from None
    if skipped and env.is_main:
        # Renamed out of the checkpoints' pattern: kept to look at, never resumed from, and never counted as the
        # newest by --keep-last (which would then delete the good ones this run saves).
        for unreadable, reason in skipped:
            kept = unreadable.with_name(unreadable.name + ".unreadable")
            unreadable.replace(kept)  # the other ranks, listing the directory meanwhile, skip a file gone
            print(f"warning: {reason}; skipped, renamed to {kept.name}", file=sys.stderr)
        print(f"warning: resuming from {path}, the newest readable checkpoint (step {saved.step})", file=sys.stderr)
    missing = saved.missing_for_resume()
    if missing:
        raise ValueError(f"{path} has no {missing[0]!r} (an averaged checkpoint?): it cannot be resumed")
    changed = changed_resume_options(saved.options or {}, options)
    if changed:
        raise ValueError(f"--resume: {path} was trained with other options; this run changes " + ", ".join(changed)
                         + ". Pass the checkpoint's values, or start a new run in another --out-dir")
    return path, saved


def _model_config(options: TrainOptions, tokenizers: Tokenizers, initial: InitialModel | None) -> TransformerConfig:
    """The initial model's config, else the preset's at the tokenizer's vocabulary size and special ids; --dropout
    replaces theirs (check_run checked --max-len against them)."""
    overrides = {} if options.dropout is None else {"dropout": options.dropout}
    if initial is not None:
        return replace(initial.config, **overrides)
    return PRESETS[options.preset](tokenizers.vocab_size, **tokenizers.special_ids, **overrides)


def _warn_of_update_size(options: TrainOptions, world_size: int, accumulation: int) -> None:
    """A warning on stderr where an update's micro-batches (whole ones on every rank) miss --update-tokens by more
    than a tenth, naming a --batch-tokens that fits it: the paper's 25k tokens on 8 ranks of 4096 would be 32,768."""
    per_update = accumulation * options.batch_tokens * world_size
    if abs(per_update - options.update_tokens) <= 0.1 * options.update_tokens:
        return
    fitting = options.update_tokens // (world_size * math.ceil(options.update_tokens / (options.batch_tokens
                                                                                       * world_size)))
    print(f"warning: an update is {accumulation} micro-batch(es) of up to {options.batch_tokens:,} tokens on each of "
          f"{world_size} rank(s), {per_update:,} tokens, not --update-tokens {options.update_tokens:,}: "
          f"--batch-tokens {fitting:,} would fit it", file=sys.stderr)


def _check_validation_split(options: TrainOptions, valid: TokenizedCorpus, max_positions: int) -> None:
    """Validation runs between updates: a split it cannot run on (check_run refused an empty one) is an error before
    the first update, not at the first validation."""
    files = corpus_files(options)["valid"]
    for side, lengths, path in (("source", valid.src_lengths, files.src), ("target", valid.tgt_lengths, files.tgt)):
        if int(lengths.max()) > max_positions:
            raise ValueError(f"a validation {side} in {path} has {int(lengths.max())} tokens with its EOS/BOS, more "
                             f"than the model's max_positions={max_positions}: shorten or drop it, or pass "
                             f"--valid-every 0")


def _rng_state(device: torch.device) -> dict:
    """This process's generators; on a GPU only its own device's (touching the others would open a context there)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class _BatchStream:
    """This rank's micro-batches, epoch after epoch; (epoch, index) is the position a checkpoint records."""

    def __init__(self, sampler: TokenBatchSampler | BucketBatchSampler, epoch: int = 0, index: int = 0) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.index = index
        self.batches = sampler.batches(epoch)

    def next(self) -> list[int] | BucketBatch:
        if self.index >= len(self.batches):
            self.epoch += 1
            self.index = 0
            self.batches = self.sampler.batches(self.epoch)
        batch = self.batches[self.index]
        self.index += 1
        return batch


class Trainer:
    """Holds the model, optimizer, data stream and schedule of one training run; `run()` trains to the budget."""

    def __init__(self, options: TrainOptions, checked: CheckedRun | None = None) -> None:
        """checked: check_run's result where the caller ran it (else it runs here)."""
        self.options = options
        self.env = _setup_distributed(options.device)
        initial = (check_run(options) if checked is None else checked).initial
        resumed = _load_resumable(options, self.env) if options.resume else None
        if self.env.is_main:
            checkpoint.remove_stale_temp_files(Path(options.out_dir))
        self.data, *extras = open_run_corpora(options, self.env.rank, self.env.world_size,
                                              None if initial is None else initial.tokenizers)
        self.tokenizers = self.data.tokenizers
        self.train_corpus = self._training_pairs(extras)
        if resumed is not None and resumed[1].tokenizer != self.tokenizers.checkpoint_entry:
            raise ValueError(f"--resume: {resumed[0]} was trained with another vocabulary than the prepared corpus "
                             f"{self.data.path} holds (its text changed since?): start a new run")
        self.config = _model_config(options, self.tokenizers, initial)
        if options.valid_every:
            _check_validation_split(options, self.data.valid, self.config.max_positions)
        # A resumed run restores its own weights; a fresh one starts from --init-from's.
        self._build_model(None if initial is None or resumed is not None else initial.weights)
        self.step = 0
        position = {"epoch": 0, "index": 0}
        if resumed is not None:
            position = self._restore(*resumed)
        self.newest_checkpoint = None if resumed is None else resumed[0]
        self.best = BestTracker(options.best_metric, None if resumed is None else resumed[1].best)
        self.validation_skipped = bool(resumed is not None and resumed[1].validation_skipped and options.valid_every)
        carried = None if resumed is None or resumed[1].log_interval is None else resumed[1].log_interval[self.env.rank]
        self.meter = _Throughput(self.env.device, carried)
        self.valid: dict = {}
        self.signals = run_control.StopSignals()
        self.stop_requested = self.out_of_time = False
        self.start = time.perf_counter()
        self.guard = run_control.DivergenceGuard(self.env.device, self.step)
        self.loss_rise = run_control.LossRiseGuard(options.max_loss_rise,
                                                   None if resumed is None else resumed[1].lowest_loss)
        sampler_class = BucketBatchSampler if options.batching == "buckets" else TokenBatchSampler
        sampler = sampler_class(self.train_corpus.src_lengths, self.train_corpus.tgt_lengths, options.batch_tokens,
                                seed=options.seed, rank=self.env.rank, world_size=self.env.world_size)
        self.stream = _BatchStream(sampler, position["epoch"], position["index"])

    def _training_pairs(self, extras: list[PreparedCorpus]) -> TokenizedCorpus:
        """The main corpus's training pairs, or (with --extra-data) those counted --upsample-primary times and the
        extra corpora's, their sources tagged with --tag-extra's token, sampled as one corpus."""
        if not extras:
            return self.data.train
        tag = None if self.options.tag_extra is None else tag_id(self.options, self.tokenizers)
        return mixed_corpus([(self.data.train, self.options.upsample_primary, None)]
                            + [(extra.train, 1, tag) for extra in extras])

    def _build_model(self, weights: dict[str, torch.Tensor] | None) -> None:
        """The model (the same initial weights on every rank: `weights`, or drawn), its DDP-wrapped loss, Adam and the
        schedule."""
        options = self.options
        # The same seed on every rank gives every rank the same initial weights (DDP also broadcasts rank 0's).
        torch.manual_seed(options.seed)
        self.model = Transformer(self.config)
        if weights is not None:
            self.model.load_state_dict(weights)
        self.model.to(self.env.device)
        # Every rank draws its own dropout masks.
        torch.manual_seed(options.seed + 1 + self.env.rank)
        lr = options.lr_scale * self.config.d_model ** -0.5
        # bf16-master: the bf16 copy trains, self.model holds the fp32 masters (checkpoints and validation use it),
        # and the ranks all-reduce the master gradients themselves, in one call per update.
        self.captured = None
        if options.step == "captured":
            self.captured = captured_training(self.model, options.label_smoothing, lr, self.env.device,
                                              options.clip_norm)
            self.master, self.loss_module = self.captured.master, self.captured.loss_module
            self.optimizer = self.captured.optimizer
        else:
            self.master = MasterWeights(self.model) if options.precision == "bf16-master" else None
            trained = self.model if self.master is None else self.master.compute
            self.loss_module = _LossModule(trained, options.label_smoothing)
            if self.env.world_size > 1 and self.master is None:
                device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
                self.loss_module = nn.parallel.DistributedDataParallel(self.loss_module, device_ids=device_ids)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
        self.scheduler = inverse_sqrt_schedule(self.optimizer, options.warmup)
        self.accumulation = max(1, round(options.update_tokens / (options.batch_tokens * self.env.world_size)))
        if self.env.is_main and not options.quiet:
            _warn_of_update_size(options, self.env.world_size, self.accumulation)

    def _restore(self, path: Path, saved: checkpoint.Checkpoint) -> checkpoint.DataPosition:
        """Restores model, optimizer, schedule, step and RNG from a checkpoint -> its data position."""
        if saved.config != self.config.to_dict():
            raise ValueError(f"{path} was trained with model config {saved.config}, this run builds "
                             f"{self.config.to_dict()}")
        expected = {"world_size": self.env.world_size, "seed": self.options.seed,
                    "batch_tokens": self.options.batch_tokens}
        for key, value in expected.items():
            if saved.data.get(key) != value:
                raise ValueError(f"{path} was written with {key}={saved.data.get(key)}, this run has {key}={value}: "
                                 f"the data order would differ, so resume with the same {key}")
        self.model.load_state_dict(saved.model)
        load_optimizer_state(self.optimizer, saved.optimizer)
        if self.master is not None:
            self.master.copy_to_compute()
        self.scheduler.load_state_dict(saved.schedule)
        self.step = saved.step
        _set_rng_state(saved.rng[self.env.rank], self.env.device)
        return saved.data

    def _next_batch(self) -> Batch:
        """The stream's next micro-batch, collated (to its bucket's shape) and checked on the CPU."""
        item = self.stream.next()
        if isinstance(item, BucketBatch):
            return self.train_corpus.batch(item.indices, self.config.vocab_size, item.shape)
        return self.train_corpus.batch(item, self.config.vocab_size)

    def _update(self) -> tuple[torch.Tensor, int, int]:
        """One optimizer step over `accumulation` micro-batches per rank -> (summed loss [] on device, target
        tokens, padded target positions), all of this rank. Leaves the update's gradient norm in self.grad_norm (on
        the device)."""
        batches = [self._next_batch() for _ in range(self.accumulation)]
        local_tokens = sum(batch.target_tokens for batch in batches)
        padded_targets = sum(batch.tgt_out.numel() for batch in batches)
        if self.captured is not None:
            for batch in batches:
                self.captured.micro_step(batch)
            total_tokens = self._sum_tokens_and_stop_votes(local_tokens)
            self._all_reduce_master_gradients()
            self.captured.update(grad_scale=1.0 / max(total_tokens, 1.0))
            self.scheduler.step()
            self.step += 1
            loss_sum = self.captured.take_loss_sum()
            self.grad_norm = self.captured.grad_norm
            self.guard.observe(loss_sum)
            if self.options.clip_norm:  # as the eager step
                self.guard.observe(self.grad_norm)
            return loss_sum, local_tokens, padded_targets
        loss_sum = torch.zeros((), device=self.env.device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16,
                                  enabled=self.env.device.type == "cuda" and self.master is None)
        for i, batch in enumerate(batches):
            tensors = (tensor.to(self.env.device, non_blocking=True) for tensor in batch[:5])
            # Gradients are all-reduced only on the last micro-batch of an update.
            sync = (self.loss_module.no_sync() if isinstance(self.loss_module, nn.parallel.DistributedDataParallel)
                    and i < len(batches) - 1 else contextlib.nullcontext())
            with sync:
                with autocast:
                    loss = self.loss_module(*tensors)
                loss.backward()
            if self.master is not None:
                self.master.accumulate_gradients()
            loss_sum += loss.detach().float()
        total_tokens = self._sum_tokens_and_stop_votes(local_tokens)
        if self.master is not None:
            self._all_reduce_master_gradients()
            # The ranks' summed gradients, to the mean over every target token of the update.
            self.master.flat_grad.mul_(1.0 / max(total_tokens, 1.0))
            grads = [self.master.flat_grad]
        else:
            # DDP averaged the ranks' summed gradients; rescale to the mean over every target token of the update.
            scale = self.env.world_size / max(total_tokens, 1.0)
            grads = [parameter.grad for parameter in self.model.parameters() if parameter.grad is not None]
            for gradient in grads:
                gradient.mul_(scale)
        self.guard.observe(loss_sum, grads)
        # Queued on the device, read only when a log line is written. Every rank holds the same (all-reduced)
        # gradients, so every rank measures and clips by the same global norm.
        self.grad_norm = torch.nn.utils.get_total_norm(grads)
        if self.options.clip_norm:
            # A norm that overflowed on finite gradients would clip them to zero: a divergence too.
            self.guard.observe(self.grad_norm)
            gradients.clip_gradients_(grads, self.options.clip_norm, self.grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        if self.master is not None:
            self.master.copy_to_compute()
            self.master.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum, local_tokens, padded_targets

    def _sum_tokens_and_stop_votes(self, local_tokens: int) -> float:
        """-> the update's target tokens over all ranks. The same all-reduce (after the backward passes) carries the
        votes to stop, a signal received and rank 0's clock past max_minutes, so that every rank stops after the same
        update with no collective of its own."""
        late = self.env.is_main and 0 < self.options.max_minutes < (time.perf_counter() - self.start) / 60
        total_tokens, stop_votes, late_votes = self.env.sum([local_tokens, self.signals.vote(), float(late)])
        self.stop_requested, self.out_of_time = stop_votes > 0, late_votes > 0
        return total_tokens

    def _check_finite(self) -> None:
        self.guard.check(self.step, self.env.sum, self.newest_checkpoint, self.options.lr_scale, self.options.warmup)

    def _all_reduce_master_gradients(self) -> None:
        if self.master is not None and self.env.world_size > 1:
            dist.all_reduce(self.master.flat_grad)

    def save(self, step: bool = True, best: bool = False) -> Path:
        """Writes the checkpoint of this step (rank 0) with every rank's RNG state: as checkpoint_<step>.pt, keeping
        the newest keep_last, and (best) as checkpoint_best.pt -> the step checkpoint's path. Weights that are not all
        finite are never written (DivergedError)."""
        self.guard.observe(tensors=self.model.parameters())
        self._check_finite()
        rng_states, log_intervals = zip(*self.env.gather((_rng_state(self.env.device), self.meter.log_interval())))
        out_dir = Path(self.options.out_dir)
        path = checkpoint.checkpoint_path(out_dir, self.step)
        if self.env.is_main:
            saved = checkpoint.Checkpoint(
                model={name: tensor.detach().cpu() for name, tensor in self.model.state_dict().items()},
                config=self.config.to_dict(),
                tokenizer=self.tokenizers.checkpoint_entry,
                step=self.step,
                optimizer=portable_optimizer_state(self.optimizer),
                schedule={key: [item.item() if isinstance(item, torch.Tensor) else item for item in value]
                          if isinstance(value, list) else value for key, value in self.scheduler.state_dict().items()},
                rng=list(rng_states),
                data=checkpoint.DataPosition(epoch=self.stream.epoch, index=self.stream.index, seed=self.options.seed,
                                             batch_tokens=self.options.batch_tokens,
                                             world_size=self.env.world_size),
                options=asdict(self.options),
                best=self.best.state,
                lowest_loss=self.loss_rise.state,
                validation_skipped=self.validation_skipped,
                log_interval=list(log_intervals),
            )
            if best:
                checkpoint.save_checkpoint(saved, checkpoint.best_checkpoint_path(out_dir))
            if step:
                checkpoint.save_checkpoint(saved, path)
                checkpoint.prune_checkpoints(out_dir, self.options.keep_last)
        self.env.barrier()
        if step:
            self.newest_checkpoint = path
        return path

    def validate(self) -> dict | None:
        """Validation loss per target token (no smoothing) and, unless --valid-bleu-sentences is 0, BLEU of the first
        valid sentences translated as `translate` does (--valid-beam, its length penalty): computed on rank 0,
        returned on every rank -> None on every rank where a stop signal to rank 0 cut it short. A signal to any rank
        sets stop_requested, so that every rank stops here rather than after another update."""
        names = ["valid_nll"] + (["valid_bleu"] if self.options.valid_bleu_sentences else [])
        results = dict.fromkeys(names, 0.0)
        cut_short = False
        if self.env.is_main:
            # Validation draws no training randomness, so a resumed run matches an uninterrupted one.
            with torch.random.fork_rng(devices=[self.env.device] if self.env.device.type == "cuda" else []):
                self.model.eval()
                nll = evaluate.corpus_nll(self.model, self.data.valid, self.options.batch_tokens, self.env.device,
                                          stop=lambda: self.signals.received is not None)
                bleu = self._valid_bleu() if "valid_bleu" in results and nll is not None else None
                cut_short = nll is None or ("valid_bleu" in results and bleu is None)
                if not cut_short:
                    results.update(valid_nll=nll, **({} if bleu is None else {"valid_bleu": bleu}))
                self.model.train()
        # Every rank takes part in keeping the best score and in stopping for --patience.
        *summed, stop_votes, cut_votes = self.env.sum(list(results.values()) + [self.signals.vote(), float(cut_short)])
        self.stop_requested = self.stop_requested or stop_votes > 0
        return None if cut_votes else dict(zip(names, summed))

    def _valid_bleu(self) -> float | None:
        """BLEU of the validation sentences, translated a chunk at a time -> None where a stop signal came between
        chunks (a long validation would outlast torchrun's --shutdown-timeout)."""
        count = self.options.valid_bleu_sentences
        pairs = self.data.valid_pairs if count == -1 else self.data.valid_pairs[:count]
        translator = Translator(self.model, self.tokenizers.source, self.tokenizers.target)
        hypotheses = []
        for start in range(0, len(pairs), VALID_CHUNK_SENTENCES):
            if self.signals.received is not None:
                return None
            hypotheses += translator.translate([pair[0] for pair in pairs[start:start + VALID_CHUNK_SENTENCES]],
                                               beam_size=self.options.valid_beam)
        return evaluate.bleu(hypotheses, [pair[1] for pair in pairs])[0][0]

    def _log(self, progress: tqdm) -> float:
        """Logs the interval's loss, lr, gradient norm (of its last update), throughput and real-token share over all
        ranks to stdout and the metrics -> the interval's train loss per token; a loss risen for good raises
        DivergedError."""
        on_grid = self.step % self.options.log_every == 0
        loss_sum, tokens, padded, rate = self.meter.read(self.env, on_grid)
        train_loss = loss_sum / max(tokens, 1.0)
        # The rate the interval's last update used: the scheduler holds the next update's already.
        lr = float(self.scheduler.base_lrs[0]) * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch - 1)
        grad_norm = self.grad_norm.item()
        if self.env.is_main and not self.options.quiet:
            progress.write(f"step {self.step} | loss {train_loss:.3f} | lr {lr:.3g} | gnorm {grad_norm:.3g} | "
                           f"{rate:,.0f} tgt tok/s | epoch {self.stream.epoch}")
        self._record(train_loss=train_loss, lr=lr, grad_norm=grad_norm, tokens_per_second=rate,
                     real_token_share=tokens / max(padded, 1.0))
        # Only the lines of the --log-every grid: a stop adds one off it, whose updates the checkpoint carries into
        # the resumed run's next line, so a run stopped and resumed reaches the verdict of one never stopped.
        if tokens and on_grid:
            self.loss_rise.observe(self.step, train_loss, Path(self.options.out_dir), self.options.lr_scale,
                                   self.options.warmup)
        return train_loss

    def _record(self, **scalars: float) -> None:
        """Rank 0 adds a record of this step to the metrics."""
        if self.metrics is not None:
            self.metrics.write({"step": self.step, "epoch": self.stream.epoch, "time": time.time(), **scalars})

    def run(self) -> TrainResult:
        """Trains to max_steps (or max_minutes, or a SIGTERM/SIGINT) under the run's backend, restoring the process's
        backend and signal handlers afterwards."""
        self.metrics = (MetricsLog(Path(self.options.out_dir), self.step, self.options.tensorboard_logdir,
                                   self.validation_skipped) if self.env.is_main else None)
        with dispatch.backend(self.options.backend), self.signals, self.metrics or contextlib.nullcontext():
            return self._run()

    def _run(self) -> TrainResult:
        options = self.options
        self.model.train()
        self.start = time.perf_counter()
        # The bar counts towards max_steps (its ETA assumes no time limit stops the run first).
        progress = tqdm(total=options.max_steps, initial=self.step, disable=options.quiet or not self.env.is_main,
                        mininterval=2.0, dynamic_ncols=True, unit="step", desc="train")
        self.meter.start_clock()
        path = None
        train_loss = math.nan
        out_of_patience = False
        if self.validation_skipped:  # by a signal's stop: done now, as the run never stopped did it
            self.validation_skipped = False
            out_of_patience = self._validate(progress)
            if out_of_patience:
                path = self.save()
        # (A signal that cut that validation short ends the session before any update.)
        while self.step < options.max_steps and not out_of_patience and not self.stop_requested:
            self.meter.add(*self._update())
            progress.update(1)
            last = self.step >= options.max_steps or self.stop_requested or self.out_of_time
            log = self.step % options.log_every == 0 or last
            due = options.valid_every and self.step % options.valid_every == 0
            # A signal's stop saves at once, its checkpoint noting a validation it skipped: torchrun SIGKILLs its
            # workers 30 s after forwarding a SIGTERM.
            validate = options.valid_every and (due or last) and not self.stop_requested
            self.validation_skipped = bool(due and self.stop_requested)
            if log or validate:
                self._check_finite()
            if log:
                train_loss = self._log(progress)
            out_of_patience = bool(validate) and self._validate(progress)
            last = last or self.stop_requested  # a signal during validation
            if (out_of_patience or last) and not log:  # an end as max_steps' is: its last interval logged
                train_loss = self._log(progress)
            if (options.save_every and self.step % options.save_every == 0) or last or out_of_patience:
                with self.meter.paused():
                    path = self.save()
            if last:
                break
        progress.close()
        if path is None:  # resumed at or past max_steps: nothing trained, the resumed checkpoint is the result
            path = checkpoint.checkpoint_path(Path(options.out_dir), self.step)
        stopped = self.stop_requested and self.step < options.max_steps
        return TrainResult(self.step, path, self.meter.overall_rate(), train_loss, self.valid,
                           (self.signals.received or "a signal to another rank") if stopped else None,
                           self.best.state, out_of_patience)

    def _validate(self, progress: tqdm) -> bool:
        """Validates, prints and records the results, and writes checkpoint_best.pt if they are the best so far ->
        whether --patience is exhausted. A stop signal ends the loop after it (stop_requested)."""
        with self.meter.paused():
            valid = self.validate()
            if valid is None:  # cut short by a stop signal: the checkpoint notes it, the resumed run does it
                self.validation_skipped = True
                return False
            self.valid = valid
            if self.env.is_main and not self.options.quiet:
                progress.write(f"step {self.step} | valid " +
                               " | ".join(f"{k} {v:.3f}" for k, v in self.valid.items()))
            self._record(**self.valid)
            if self.best.observe(self.valid, self.step):
                self.save(step=False, best=True)
        return self.best.exhausted(self.options.patience)


class _Throughput:
    """Sums this rank's loss and target tokens since the last log line on the --log-every grid, and times training
    alone since the last log line: validation and checkpointing run inside `paused()` and are not counted."""

    def __init__(self, device: torch.device, carried: checkpoint.LogInterval | None = None) -> None:
        """carried: the sums a resumed checkpoint holds."""
        carried = carried or {"loss_sum": 0.0, "tokens": 0, "padded": 0}
        self.loss_sum = torch.tensor(carried["loss_sum"], dtype=torch.float32, device=device)
        self.tokens = carried["tokens"]
        self.padded = carried["padded"]
        self.timed_tokens = 0  # this session's, for the rate
        self.total_tokens = 0.0
        self.total_seconds = 0.0
        self.start_clock()

    def start_clock(self) -> None:
        self.interval_start = time.perf_counter()
        self.interval_paused = 0.0

    def add(self, loss_sum: torch.Tensor, tokens: int, padded: int) -> None:
        self.loss_sum += loss_sum
        self.tokens += tokens
        self.padded += padded
        self.timed_tokens += tokens

    def log_interval(self) -> checkpoint.LogInterval:
        return {"loss_sum": self.loss_sum.item(), "tokens": self.tokens, "padded": self.padded}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.interval_paused += time.perf_counter() - begin

    def read(self, env: _Distributed, on_grid: bool) -> tuple[float, float, float, float]:
        """-> (summed loss, target tokens, padded target positions) since the last line on the grid and target
        tokens/s since the last line, over all ranks; a line on the grid starts a new interval (one off it, a run's
        last, leaves its sums for the checkpoint)."""
        # The loss is read back only here, so the steps in between queue on a GPU without a host sync.
        loss_sum, tokens, padded, timed_tokens = env.sum([self.loss_sum.item(), float(self.tokens),
                                                          float(self.padded), float(self.timed_tokens)])
        now = time.perf_counter()
        seconds = max(now - self.interval_start - self.interval_paused, 1e-9)
        self.total_tokens += timed_tokens
        self.total_seconds += seconds
        if on_grid:
            self.loss_sum.zero_()
            self.tokens = self.padded = 0
        self.timed_tokens = 0
        self.interval_start, self.interval_paused = now, 0.0
        return loss_sum, tokens, padded, timed_tokens / seconds

    def overall_rate(self) -> float:
        return self.total_tokens / max(self.total_seconds, 1e-9)


def portable_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() as the eager Adam writes it, whatever the optimizer's implementation flags: a float lr
    and no fused/capturable switches, so that a checkpoint resumes on any device and step (its state tensors, the
    step counts included, are the same in every implementation)."""
    state = optimizer.state_dict()
    groups = []
    for group in state["param_groups"]:
        group = dict(group)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = group["lr"].item()
        for flag in ("fused", "capturable"):
            if flag in group:
                group[flag] = None if flag == "fused" else False
        groups.append(group)
    # Copies, so that the saved state never aliases the live one (as a CPU tensor's .cpu() would).
    return {"state": {index: {name: value.to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
                              for name, value in entry.items()} for index, entry in state["state"].items()},
            "param_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Loads a portable_optimizer_state into optimizer, keeping its own implementation flags (and an lr tensor, set
    to the saved lr)."""
    groups = []
    for group, own in zip(state["param_groups"], optimizer.param_groups):
        group = dict(group)
        for flag in ("fused", "capturable"):
            if flag in own:
                group[flag] = own[flag]
        if isinstance(own["lr"], torch.Tensor):
            group["lr"] = own["lr"].fill_(group["lr"])
        groups.append(group)
    optimizer.load_state_dict({"state": state["state"], "param_groups": groups})
