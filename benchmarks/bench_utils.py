"""What both benchmark scripts share: WMT-like synthetic batches, timing, memory, the run's environment, outputs."""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cpu_info import cpu_description, cpu_name_and_flags
from fastformer import data
from fastformer.data import BucketBatch, BucketBatchSampler, TokenizedCorpus, token_budget_batches

REPO = Path(__file__).resolve().parents[1]
# Runs write here unless told otherwise: git ignores /runs/, so a run never dirties the checkout. Results worth
# keeping are copied into benchmarks/results/ with their command.
RUNS = REPO / "runs" / "benchmarks"

# Dense bf16 tensor-core peaks in TFLOP/s (vendor datasheets, without sparsity), matched against the device name.
# The H200 has the H100 SXM's compute, with more and faster memory.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("A100", 312.0),
)

# WMT14 En-De after a 37k shared BPE (the paper's setup): targets average ~27 subwords with a long right tail.
WMT_MEAN_TARGET_LEN = 27.0
WMT_LOG_SIGMA = 0.55
WMT_SOURCE_RATIO_SIGMA = 0.2
WMT_VOCAB = 37000
PAD_MULTIPLE = 8  # batches are padded to a multiple of 8 tokens, as fairseq does for tensor cores
BUCKET_SAMPLE_BATCHES = 400  # batches' worth of pairs drawn to bucket (bucket_sample_size)
# The packages whose sources a run's commit vouches for (stale_install): fastformer and its Triton kernels.
SOURCE_PACKAGES = ("fastformer", "triton_kernels")


def bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by name, or None for a device not in the table (then no MFU is reported)."""
    for key, tflops in BF16_PEAK_TFLOPS:
        if key in device_name:
            return tflops
    return None


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (platform.processor() says only "x86_64" on Linux)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({cpu_name_and_flags()[0]})"


def environment(device: torch.device) -> dict:
    """Device, versions and commit of this run, and where its fastformer was imported from, for the JSON."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device) if device.type == "cuda" else cpu_description(),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        # The threads torch runs on, which set CTranslate2's where a script gives it torch's count.
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        # fastformer's switches of its CPU code (FASTFORMER_CPU_ISA, _VNNI, _AMX) where the run set them.
        "fastformer_cpu_switches": {name: value for name, value in sorted(os.environ.items())
                                    if name.startswith("FASTFORMER_CPU_")},
        "commit": git_commit(),
        "fastformer_path": str(imported_packages()["fastformer"]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def command_line(argv: list[str]) -> str:
    """A run's command as its JSON records it: OMP_NUM_THREADS first (it sets the threads of torch and of a worker's
    CTranslate2), then python and argv."""
    return " ".join([f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", "python", *argv])


def ctranslate2_version() -> str | None:
    """The installed CTranslate2's version, for the JSON of a run that times it; None where it is not installed."""
    try:
        import ctranslate2
    except ImportError:
        return None
    return ctranslate2.__version__


def git_commit() -> str | None:
    """$FASTFORMER_COMMIT where set (it names the tree that runs, as ab_throughput.py and a copy without git history
    set it), else HEAD's hash with "+dirty" when the tree has uncommitted changes (None outside a git checkout); then
    "+stale-install" when the fastformer imported is not this checkout's source (stale_install)."""
    commit = os.environ.get("FASTFORMER_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                    check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
        commit += "+dirty" if dirty else ""
    return commit + ("+stale-install" if stale_install(imported_packages(), REPO) else "")


def imported_packages() -> dict[str, Path | None]:
    """-> the folder each of SOURCE_PACKAGES is imported from (None: not found), looked up without importing them
    (triton_kernels imports triton)."""
    folders = {}
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        folders[name] = Path(spec.origin).resolve().parent if spec and spec.origin else None
    return folders


def stale_install(packages: dict[str, Path | None], checkout: Path) -> bool:
    """Whether the imported packages' Python sources differ from the checkout's working tree: a file on one side only
    or with other contents. A non-editable install keeps the sources of when it was installed, so a run after an edit
    times other code than the commit names; False where the checkout holds no sources (a copy of benchmarks/)."""
    if not all((checkout / name).is_dir() for name in packages):
        return False

    def sources(folder: Path | None) -> dict[Path, bytes]:
        return {} if folder is None else {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*.py")}

    return any(sources(folder) != sources((checkout / name).resolve()) for name, folder in packages.items()
               if folder != (checkout / name).resolve())


def default_out_dir(device: torch.device) -> Path:
    """runs/benchmarks/<date>-<device>/, the device name reduced to a file-name-safe slug; the first of -b, -c, ...
    after it where that folder exists (an earlier run's of the same day)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return first_free(RUNS / f"{datetime.date.today().isoformat()}-{slug}")


def first_free(folder: Path) -> Path:
    """folder, or where it exists the first of folder-b, folder-c, ..., folder-z, folder-aa, ... that does not (the
    results folders' naming)."""
    candidate, n = folder, 1
    while candidate.exists():
        n += 1
        letters, rest = "", n
        while rest:
            rest, digit = divmod(rest - 1, 26)
            letters = chr(ord("a") + digit) + letters
        candidate = folder.with_name(f"{folder.name}-{letters}")
    return candidate


def output_problem(path: Path, folder: bool = False) -> str | None:
    """Why `path` cannot be written as an output file (or, folder, made as an output folder), or None; looks only,
    so that a run finds out before its timing, not after."""
    if path.exists():
        if path.is_dir() != folder:
            return "is a file, not a folder" if folder else "is a folder, not a file"
        return None if os.access(path, os.W_OK | (os.X_OK if folder else 0)) else "is not writable"
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot be made: {ancestor} is a file"
    return None if os.access(ancestor, os.W_OK | os.X_OK) else f"cannot be made: {ancestor} is not writable"


def check_output(parser: argparse.ArgumentParser, option: str, path: Path, folder: bool = False) -> None:
    """parser.error (one line) when `path` cannot be written (output_problem)."""
    problem = output_problem(path, folder)
    if problem:
        parser.error(f"{option} {path} {problem}")


def int_at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """-> an argparse type: an integer >= minimum, anything else refused in one line (saying why, where given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{f' ({why})' if why else ''}, not {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------------
# Timing and memory


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after `warmup` untimed calls; the device is drained around each."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def calls_in_turn(runs: dict[str, Callable[[], object]], rounds: int,
                  on_round: Callable[[int, dict[str, list[float]]], None] | None = None) -> dict[str, list[float]]:
    """Each round calls every run once, the order rotated a place a round, so that calls compared within a round run
    seconds apart and none always follows the same other -> each run's seconds, round by round (on the CPU: nothing
    to drain); on_round(round index, the seconds so far) after each round."""
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
        if on_round:
            on_round(round_index, seconds)
    return seconds


def summary(samples: list[float]) -> dict:
    """Median and spread of repeated measurements (all samples kept for the JSON)."""
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1], "n": len(ordered),
            "samples": ordered}


def spread_percent(stats: dict) -> float:
    """(max - min) / median of a `summary`, in percent."""
    return 100.0 * (stats["max"] - stats["min"]) / stats["median"] if stats["median"] else 0.0


def reset_peak_memory(device: torch.device) -> int:
    """Starts a peak-memory window on CUDA; -> the bytes allocated now (0 on CPU, where peaks are not tracked)."""
    if device.type != "cuda":
        return 0
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes allocated since `reset_peak_memory`, or None on CPU."""
    if device.type != "cuda":
        return None
    synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def free_memory(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------------
# WMT-like synthetic data


def wmt_lengths(n: int, generator: torch.Generator, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (source lengths with EOS, bare target lengths) [n]: lognormal targets (mean ~27, WMT14 after BPE), each
    source the target times a lognormal ratio; both capped so that a sequence with BOS/EOS fits in max_len."""
    mu = math.log(WMT_MEAN_TARGET_LEN) - WMT_LOG_SIGMA ** 2 / 2
    target = torch.exp(mu + WMT_LOG_SIGMA * torch.randn(n, generator=generator, dtype=torch.float64))
    ratio = torch.exp(WMT_SOURCE_RATIO_SIGMA * torch.randn(n, generator=generator, dtype=torch.float64))
    tgt = target.round().clamp(1, max_len - 1).long()
    src = (target * ratio).round().clamp(1, max_len - 1).long() + 1
    return src, tgt


def padded(length: int) -> int:
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE


def token_budget_groups(src_lengths: torch.Tensor, tgt_lengths: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """fairseq's batching: sentences sorted by length, grouped while batch x longest padded side <= max_tokens."""
    order = sorted(range(len(tgt_lengths)), key=lambda i: (int(tgt_lengths[i]), int(src_lengths[i])))
    sides = [padded(max(int(src), int(tgt) + 1)) for src, tgt in zip(src_lengths, tgt_lengths)]
    return token_budget_batches(order, sides, max_tokens)


@dataclass
class Batch:
    src: torch.Tensor  # [batch, src_len], ends in EOS, right-padded
    tgt_in: torch.Tensor  # [batch, tgt_len] = [BOS, y]
    tgt_out: torch.Tensor  # [batch, tgt_len] = [y, EOS]
    src_lengths: torch.Tensor  # [batch], with EOS
    tgt_lengths: torch.Tensor  # [batch], of tgt_in (= target tokens of tgt_out)
    # Rows [0, pairs) hold sentence pairs; the rest are a bucket's filler rows (src [EOS], tgt_in [BOS], tgt_out all
    # padding, lengths 1 and 1, as fastformer.data pads a bucket), which the model computes but hold no real token.
    pairs: int

    @property
    def real_src_lengths(self) -> torch.Tensor:
        """[pairs]: source lengths of the sentence pairs, with EOS."""
        return self.src_lengths[:self.pairs]

    @property
    def real_tgt_lengths(self) -> torch.Tensor:
        """[pairs]: target lengths of the sentence pairs (tokens of tgt_out)."""
        return self.tgt_lengths[:self.pairs]

    @property
    def target_tokens(self) -> int:
        return int(self.real_tgt_lengths.sum())

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device) for t in (self.src, self.tgt_in, self.tgt_out, self.src_lengths,
                                                 self.tgt_lengths)), self.pairs)

    def training_batch(self) -> data.Batch:
        """-> the batch as fastformer's training collates it (what CapturedStep.micro_step takes)."""
        return data.Batch(self.src, self.tgt_in, self.tgt_out, self.src_lengths, self.tgt_lengths, self.target_tokens)


def make_batch(src_lengths: torch.Tensor, tgt_lengths: torch.Tensor, vocab_size: int, generator: torch.Generator,
               pad_id: int = 0, bos_id: int = 1, eos_id: int = 2) -> Batch:
    """Random ids in [3, vocab) for the given source lengths (with EOS) and bare target lengths; padded to x8."""
    batch = len(src_lengths)
    src_len, tgt_len = padded(int(src_lengths.max())), padded(int(tgt_lengths.max()) + 1)
    src = torch.randint(3, vocab_size, (batch, src_len), generator=generator)
    src[torch.arange(batch), src_lengths - 1] = eos_id
    src[torch.arange(src_len)[None, :] >= src_lengths[:, None]] = pad_id
    y = torch.randint(3, vocab_size, (batch, tgt_len), generator=generator)
    positions = torch.arange(tgt_len)[None, :]
    tgt_in = torch.cat([torch.full((batch, 1), bos_id), y[:, :-1]], dim=1)
    tgt_in[positions > tgt_lengths[:, None]] = pad_id
    tgt_out = y.clone()
    tgt_out[torch.arange(batch), tgt_lengths] = eos_id
    tgt_out[positions > tgt_lengths[:, None]] = pad_id
    return Batch(src, tgt_in, tgt_out, src_lengths.clone(), tgt_lengths + 1, batch)


def sample_size(n_batches: int, max_tokens: int) -> int:
    """Sentence pairs drawn to make n_batches batches of max_tokens: enough that every length is well represented."""
    return max(64, 8 * n_batches * max_tokens // int(WMT_MEAN_TARGET_LEN))


def picked(n_items: int, n_picks: int) -> list[int]:
    """Evenly spaced indices into n_items items sorted by length: short, typical and long ones all represented."""
    return sorted({round(i * (n_items - 1) / max(1, n_picks - 1)) for i in range(n_picks)})


def wmt_batches(n_batches: int, max_tokens: int, vocab_size: int, max_len: int, seed: int = 0) -> list[Batch]:
    """n_batches token-budget batches of WMT-like pairs, taken at evenly spaced length quantiles of the batching of a
    sample large enough to fill them, so that short, typical and long batches are all represented."""
    generator = torch.Generator().manual_seed(seed)
    src_lengths, tgt_lengths = wmt_lengths(sample_size(n_batches, max_tokens), generator, max_len)
    groups = token_budget_groups(src_lengths, tgt_lengths, max_tokens)
    return [make_batch(src_lengths[groups[i]], tgt_lengths[groups[i]], vocab_size, generator)
            for i in picked(len(groups), n_batches)]


def wmt_bucket_epoch(n_sentences: int, max_tokens: int, max_len: int,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[BucketBatch]]:
    """n_sentences WMT-like pairs (wmt_lengths with `seed`, as wmt_batches draws them) in the static-shape batches of
    fastformer's `--batching buckets` (BucketBatchSampler's epoch 0: every pair exactly once), sorted by padded length
    per pair -> (source lengths with EOS [n], tgt_in lengths [n], the batches)."""
    src_lengths, tgt_lengths = wmt_lengths(n_sentences, torch.Generator().manual_seed(seed), max_len)
    tgt_in_lengths = tgt_lengths + 1
    sampler = BucketBatchSampler(src_lengths, tgt_in_lengths, max_tokens, seed=seed)
    epoch = sorted(sampler.all_batches(0), key=lambda b: (b.shape.src_len + b.shape.tgt_len, b.shape))
    return src_lengths, tgt_in_lengths, epoch


def collate_buckets(buckets: list[BucketBatch], src_lengths: torch.Tensor, tgt_lengths: torch.Tensor,
                    vocab_size: int, seed: int = 0) -> list[Batch]:
    """Random ids in [3, vocab) for the pairs of the buckets (src_lengths with EOS, tgt_lengths of tgt_in), collated
    to each bucket's shape as fastformer's training collates them (TokenizedCorpus.batch: pad 0, BOS 1, EOS 2)."""
    generator = torch.Generator().manual_seed(seed + 1)
    members = [i for bucket in buckets for i in bucket.indices]
    bare_src = (src_lengths[members] - 1).tolist()  # TokenizedCorpus appends the EOS
    bare_tgt = (tgt_lengths[members] - 1).tolist()  # and adds BOS / EOS to targets
    src_ids = torch.randint(3, vocab_size, (sum(bare_src),), generator=generator).split(bare_src)
    tgt_ids = torch.randint(3, vocab_size, (sum(bare_tgt),), generator=generator).split(bare_tgt)
    corpus = TokenizedCorpus.from_lists([ids.tolist() for ids in src_ids], [ids.tolist() for ids in tgt_ids],
                                        pad_id=0, bos_id=1, eos_id=2)
    batches, start = [], 0
    for bucket in buckets:
        collated = corpus.batch(list(range(start, start + len(bucket.indices))), vocab_size, bucket.shape)
        batches.append(Batch(*collated[:5], len(bucket.indices)))
        start += len(bucket.indices)
    return batches


def bucket_sample_size(max_tokens: int) -> int:
    """Pairs drawn to bucket: enough for ~8 batches in each of BucketBatchSampler's (at most 64) buckets, so that the
    few pairs a bucket cannot fill a batch with pad about as little as at WMT scale (4.5M pairs)."""
    return max(64, BUCKET_SAMPLE_BATCHES * max_tokens // int(WMT_MEAN_TARGET_LEN))


def typical_buckets(epoch: list[BucketBatch], src_lengths: torch.Tensor, tgt_lengths: torch.Tensor,
                    n_picks: int) -> list[BucketBatch]:
    """One batch from each of n_picks equal slices of the epoch (sorted by length): short, typical and long batches;
    from each slice, the batch of median real-token share, so that a few batches pad as the slice typically does
    rather than as its best or worst batch."""
    def real_share(bucket: BucketBatch) -> float:
        real = int(src_lengths[bucket.indices].sum()) + int(tgt_lengths[bucket.indices].sum())
        return real / (bucket.shape.sentences * (bucket.shape.src_len + bucket.shape.tgt_len))

    bounds = [round(i * len(epoch) / n_picks) for i in range(n_picks + 1)]
    slices = [sorted(epoch[start:end], key=real_share) for start, end in zip(bounds, bounds[1:]) if end > start]
    return [part[len(part) // 2] for part in slices]


@functools.lru_cache(maxsize=2)  # every system of a preset trains the same batches: built once (read-only)
def wmt_bucket_batches(n_batches: int, max_tokens: int, vocab_size: int, max_len: int, seed: int = 0) -> list[Batch]:
    """n_batches static-shape batches of WMT-like pairs (typical_buckets of the wmt_bucket_epoch of a sample large
    enough to fill every bucket)."""
    src_lengths, tgt_lengths, epoch = wmt_bucket_epoch(bucket_sample_size(max_tokens), max_tokens, max_len, seed)
    return collate_buckets(typical_buckets(epoch, src_lengths, tgt_lengths, n_batches), src_lengths, tgt_lengths,
                           vocab_size, seed)


# ---------------------------------------------------------------------------------------------------------------------
# Tables


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows of dicts -> a plain-text table; columns are (key, header) pairs, floats shown with 3 significant digits."""
    def cell(value: object) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return str(value)

    body = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(header), *(len(line[i]) for line in body)) if body else len(header)
              for i, (_, header) in enumerate(columns)]
    lines = ["  ".join(header.ljust(w) for (_, header), w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(text.ljust(w) for text, w in zip(line, widths)) for line in body]
    return "\n".join(lines)


def verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    """PASS/MISS of a measured value against its target; n/a when it was not measured."""
    if value is None:
        return "n/a"
    return "PASS" if (value >= target if higher_is_better else value <= target) else "MISS"
