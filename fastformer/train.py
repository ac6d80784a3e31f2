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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import fastformer
from fastformer import checkpoint, evaluate
from fastformer.config import TransformerConfig
from fastformer.data import (LengthFilter, TokenBatchSampler, TokenizedCorpus, Tokenizer, find_split, read_parallel,
                             train_tokenizer)
from fastformer.model import Transformer

PRESETS = {"tiny": TransformerConfig.tiny, "base": TransformerConfig.base, "big": TransformerConfig.big}
TOKENIZER_FILE = "spm.model"


@dataclass
class TrainOptions:
    out_dir: str = "runs/demo"
    data_dir: str | None = None  # None: the bundled toy corpus
    src_lang: str = "en"
    tgt_lang: str = "de"
    preset: str = "tiny"
    vocab_size: int | None = None  # None: 37000 as the paper for a corpus on disk, 1000 for the bundled one
    dropout: float | None = None  # None: the preset's
    batch_tokens: int = 4096  # padded tokens per micro-batch and rank (each side)
    update_tokens: int = 25000  # tokens per update over all ranks, reached by gradient accumulation
    lr_scale: float = 1.0
    warmup: int = 4000
    label_smoothing: float = 0.1
    max_steps: int = 100_000
    max_minutes: float = 0.0  # 0: no time limit
    log_every: int = 100
    valid_every: int = 1000  # 0: no validation
    valid_bleu_sentences: int = 200
    save_every: int = 1000
    keep_last: int = 5
    seed: int = 1
    device: str = "auto"
    backend: str = "auto"
    resume: bool = False
    min_len: int = 3
    max_len: int = 150
    max_ratio: float = 2.0
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {self.preset!r}")
        for name in ("batch_tokens", "update_tokens", "warmup", "max_steps", "log_every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("valid_every", "save_every", "valid_bleu_sentences", "max_minutes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")


@dataclass
class TrainResult:
    step: int
    checkpoint: Path
    tokens_per_second: float  # target tokens (non-padding) per second over all ranks
    train_loss: float
    valid: dict = field(default_factory=dict)


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule: scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), steps counted from 1."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class _LossModule(nn.Module):
    """DistributedDataParallel synchronizes through forward(), so the summed loss is this wrapper's forward."""

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        """src: [batch, src_len], tgt_in/tgt_out: [batch, tgt_len] -> summed label-smoothed loss: []."""
        return self.model.loss(src, tgt_in, tgt_out, label_smoothing=self.label_smoothing, reduction="sum")


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
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
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
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_option == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_option)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    return _Distributed(rank, world_size, device)


def _prepare_tokenizer(options: TrainOptions, train_pairs: list[tuple[str, str]], env: _Distributed) -> Tokenizer:
    """The run's shared vocabulary: trained once by rank 0 into out_dir, then read by every rank."""
    path = Path(options.out_dir) / TOKENIZER_FILE
    if env.is_main and not path.exists():
        vocab_size = options.vocab_size or (1000 if options.data_dir is None else 37000)
        tokenizer = train_tokenizer((sentence for pair in train_pairs for sentence in pair), vocab_size=vocab_size)
        temp = path.with_name(path.name + ".tmp")
        tokenizer.save(temp)
        os.replace(temp, path)
    env.barrier()
    return Tokenizer.load(path)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _BatchStream:
    """This rank's micro-batches, epoch after epoch; (epoch, index) is the position a checkpoint records."""

    def __init__(self, sampler: TokenBatchSampler, epoch: int = 0, index: int = 0) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.index = index
        self.batches = sampler.batches(epoch)

    def next(self) -> list[int]:
        if self.index >= len(self.batches):
            self.epoch += 1
            self.index = 0
            self.batches = self.sampler.batches(self.epoch)
        batch = self.batches[self.index]
        self.index += 1
        return batch


class Trainer:
    """Holds the model, optimizer, data stream and schedule of one training run; `run()` trains to the budget."""

    def __init__(self, options: TrainOptions) -> None:
        self.options = options
        self.env = _setup_distributed(options.device)
        fastformer.set_backend(options.backend)
        out_dir = Path(options.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        data_dir = None if options.data_dir is None else Path(options.data_dir)
        train_files = find_split(data_dir, "train", options.src_lang, options.tgt_lang)
        train_pairs = read_parallel(train_files.src, train_files.tgt)
        self.tokenizer = _prepare_tokenizer(options, train_pairs, self.env)
        length_filter = LengthFilter(options.min_len, options.max_len, options.max_ratio)
        self.train_data = TokenizedCorpus.encode(self.tokenizer, train_pairs, length_filter)
        valid_files = find_split(data_dir, "valid", options.src_lang, options.tgt_lang)
        self.valid_pairs = read_parallel(valid_files.src, valid_files.tgt)
        self.valid_data = TokenizedCorpus.encode(self.tokenizer, self.valid_pairs)

        overrides = {} if options.dropout is None else {"dropout": options.dropout}
        self.config = PRESETS[options.preset](self.tokenizer.vocab_size, **overrides)
        torch.manual_seed(options.seed)
        self.model = Transformer(self.config).to(self.env.device)
        # Every rank starts from the same weights but draws its own dropout masks.
        torch.manual_seed(options.seed + 1 + self.env.rank)
        self.loss_module: nn.Module = _LossModule(self.model, options.label_smoothing)
        if self.env.world_size > 1:
            device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
            self.loss_module = nn.parallel.DistributedDataParallel(self.loss_module, device_ids=device_ids)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
        self.accumulation = max(1, round(options.update_tokens / (options.batch_tokens * self.env.world_size)))
        sampler = TokenBatchSampler(self.train_data.src_lengths, self.train_data.tgt_lengths, options.batch_tokens,
                                    seed=options.seed, rank=self.env.rank, world_size=self.env.world_size)
        self.step = 0
        position = {"epoch": 0, "index": 0}
        if options.resume:
            position = self._resume()
        self.stream = _BatchStream(sampler, position["epoch"], position["index"])

    def _resume(self) -> dict:
        """Restores model, optimizer, step, RNG and data position from the newest checkpoint in out_dir."""
        found = checkpoint.list_checkpoints(Path(self.options.out_dir))
        if not found:
            raise FileNotFoundError(f"--resume: no checkpoint_*.pt in {self.options.out_dir}")
        path = found[-1]
        state = checkpoint.load_checkpoint(path, map_location=self.env.device)
        if state["config"] != self.config.to_dict():
            raise ValueError(f"{path} was trained with model config {state['config']}, this run builds "
                             f"{self.config.to_dict()}")
        if "optimizer" not in state:
            raise ValueError(f"{path} has no optimizer state (an averaged checkpoint?): it cannot be resumed")
        if state["data"]["world_size"] != self.env.world_size:
            raise ValueError(f"{path} was written by {state['data']['world_size']} processes; resume it with as "
                             f"many (this run has {self.env.world_size})")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        _set_rng_state(state["rng"][self.env.rank])
        return state["data"]

    def _update(self) -> tuple[float, float]:
        """One optimizer step over `accumulation` micro-batches per rank -> (summed loss, target tokens), local."""
        batches = [self.train_data.collate(self.stream.next()) for _ in range(self.accumulation)]
        local_tokens = sum(int((tgt_out != self.config.pad_id).sum()) for _, _, tgt_out in batches)
        total_tokens = self.env.sum([local_tokens])[0]
        loss_sum = 0.0
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.env.device.type == "cuda")
        for i, batch in enumerate(batches):
            src, tgt_in, tgt_out = (tensor.to(self.env.device, non_blocking=True) for tensor in batch)
            # Gradients are all-reduced only on the last micro-batch of an update.
            sync = (self.loss_module.no_sync() if isinstance(self.loss_module, nn.parallel.DistributedDataParallel)
                    and i < len(batches) - 1 else contextlib.nullcontext())
            with sync:
                with autocast:
                    loss = self.loss_module(src, tgt_in, tgt_out)
                loss.backward()
            loss_sum += loss.item()
        # DDP averaged the ranks' summed gradients; rescale to the mean over every target token of the update.
        for parameter in self.model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(self.env.world_size / total_tokens)
        self.step += 1
        lr = inverse_sqrt_lr(self.step, self.config.d_model, self.options.warmup, self.options.lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, float(local_tokens)

    def save(self) -> Path:
        """Writes checkpoint_<step>.pt (rank 0) with every rank's RNG state, keeping the newest keep_last."""
        rng_states = self.env.gather(_rng_state())
        path = checkpoint.checkpoint_path(Path(self.options.out_dir), self.step)
        if self.env.is_main:
            state = {
                "model": {name: tensor.detach().cpu() for name, tensor in self.model.state_dict().items()},
                "config": self.config.to_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "schedule": {"warmup": self.options.warmup, "lr_scale": self.options.lr_scale,
                             "d_model": self.config.d_model},
                "rng": rng_states,
                "data": {"epoch": self.stream.epoch, "index": self.stream.index, "seed": self.options.seed,
                         "world_size": self.env.world_size},
                "tokenizer": torch.frombuffer(bytearray(self.tokenizer.model_proto), dtype=torch.uint8),
                "options": asdict(self.options),
            }
            checkpoint.save_checkpoint(state, path)
            checkpoint.prune_checkpoints(Path(self.options.out_dir), self.options.keep_last)
        self.env.barrier()
        return path

    def validate(self) -> dict:
        """Rank 0: validation loss per target token (no smoothing) and greedy BLEU on the first valid sentences."""
        results: dict = {}
        if self.env.is_main:
            # Validation draws no training randomness, so a resumed run matches an uninterrupted one.
            with torch.random.fork_rng(devices=[self.env.device] if self.env.device.type == "cuda" else []):
                self.model.eval()
                results["valid_nll"] = evaluate.corpus_nll(self.model, self.valid_data, self.options.batch_tokens,
                                                           self.env.device)
                if self.options.valid_bleu_sentences:
                    pairs = self.valid_pairs[:self.options.valid_bleu_sentences]
                    hypotheses = evaluate.translate_sentences(self.model, self.tokenizer, [p[0] for p in pairs],
                                                              beam_size=1)
                    results["valid_bleu"] = evaluate.bleu(hypotheses, [p[1] for p in pairs])[0][0]
                self.model.train()
        self.env.barrier()
        return results

    def run(self) -> TrainResult:
        options, env = self.options, self.env
        self.model.train()
        start = time.perf_counter()
        progress = tqdm(total=options.max_steps, initial=self.step, disable=options.quiet or not env.is_main,
                        mininterval=2.0, dynamic_ncols=True, unit="step")
        interval_loss = interval_tokens = 0.0
        total_tokens = 0.0
        interval_start = start
        last_saved = -1
        valid: dict = {}
        train_loss = math.nan
        while self.step < options.max_steps:
            loss_sum, tokens = self._update()
            interval_loss += loss_sum
            interval_tokens += tokens
            progress.update(1)
            # Rank 0's clock decides, so every rank stops after the same step.
            out_of_time = env.is_main and options.max_minutes > 0 and \
                time.perf_counter() - start > 60 * options.max_minutes
            last = self.step >= options.max_steps or env.sum([float(out_of_time)])[0] > 0
            if self.step % options.log_every == 0 or last:
                loss_all, tokens_all = env.sum([interval_loss, interval_tokens])
                now = time.perf_counter()
                train_loss = loss_all / max(tokens_all, 1.0)
                total_tokens += tokens_all
                message = (f"step {self.step} | loss {train_loss:.3f} | lr {self.optimizer.param_groups[0]['lr']:.3g}"
                           f" | {tokens_all / (now - interval_start):,.0f} tgt tok/s | epoch {self.stream.epoch}")
                if env.is_main and not options.quiet:
                    progress.write(message)
                interval_loss = interval_tokens = 0.0
                interval_start = now
            if options.valid_every and (self.step % options.valid_every == 0 or last):
                valid = self.validate()
                if env.is_main and not options.quiet:
                    progress.write(f"step {self.step} | valid " + " | ".join(f"{k} {v:.3f}" for k, v in valid.items()))
            if (options.save_every and self.step % options.save_every == 0) or last:
                path = self.save()
                last_saved = self.step
            if last:
                break
        progress.close()
        elapsed = time.perf_counter() - start
        if last_saved != self.step:
            path = self.save()
        return TrainResult(self.step, path, total_tokens / max(elapsed, 1e-9), train_loss, valid)


def train(options: TrainOptions) -> TrainResult:
    """Trains to options.max_steps (or options.max_minutes) and returns the final checkpoint and throughput."""
    return Trainer(options).run()
