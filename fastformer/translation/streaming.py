"""Streaming line-aligned input files through a per-chunk function into an output file, in bounded memory, with a
progress bar and a resumable output: what `fastformer translate` (and any command that maps input lines to output
lines) runs.

    summary = stream_chunks([LineInput("in.en", file)], start, Path("out.de"), settings={"--beam": 4})
    print(summary.line("translate"), file=sys.stderr)

The inputs are read in lockstep, chunk_lines rows at a time; a row is the tuple of one line of each input. Each chunk
goes through the chunk function, and its output lines are written, flushed and synced before the next chunk is read:
at most one chunk of input is held, whatever the files' size. An output file gets a sidecar, `<output>.progress`
(JSON), rewritten after each chunk: the input rows done, the output bytes and lines that hold them, SHA-256s of the
rows done and of those bytes, and the settings that shape the output. It is removed when the run ends. `resume=True`
continues from it: the output is cut back to the last chunk it records, and a changed input (its rows done differ,
or it has fewer), changed settings or a changed output are refused before any work. An output that is not a regular
file (/dev/null, a pipe) is written without a sidecar, and cannot be resumed. A chunk also ends where standard input
(StdinLines) has no line ready, so that a program that sends a line and waits gets its translation.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice, zip_longest
from pathlib import Path
from typing import BinaryIO, NamedTuple, TextIO

from tqdm import tqdm

from fastformer.data import decode_sentences

PROGRESS_SUFFIX = ".progress"
PROGRESS_FORMAT = 2


class LineInput(NamedTuple):
    """One input of a streamed run."""

    name: str  # as messages name it: its path, "stdin"
    lines: Iterable[bytes]  # its raw lines, line ends included
    count: int | None = None  # its number of lines where known before reading (a file), checked before any work
    ready: Callable[[], bool] | None = None  # whether a next line can be read without waiting; None: always


class StdinLines:
    """Standard input's raw lines (line ends included), read straight from its file descriptor, and whether the next
    one can be read without waiting: what a pipe or terminal holds is known, which a buffered reader's is not."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self.lines: deque[bytes] = deque()
        # A line not yet ended, in the pieces read: joined once it ends, as each read's rescan of the whole would
        # take time quadratic in its length (a pipe gives 64 KiB a read: 75 s for a 100 MiB line).
        self.partial: list[bytes] = []
        self.ended = False

    def _read(self) -> None:
        data = os.read(self.fd, 1 << 20)
        if not data:
            self.ended = True
            if self.partial:
                self.lines.append(b"".join(self.partial))
                self.partial = []
            return
        parts = data.split(b"\n")
        if len(parts) > 1:
            parts[0] = b"".join(self.partial + [parts[0]])
            self.partial = []
            self.lines.extend(part + b"\n" for part in parts[:-1])
        if parts[-1]:
            self.partial.append(parts[-1])

    def __iter__(self) -> Iterator[bytes]:
        while True:
            while not self.lines and not self.ended:
                self._read()
            if not self.lines:
                return
            yield self.lines.popleft()

    def ready(self) -> bool:
        return bool(self.lines) or self.ended or bool(select.select([self.fd], [], [], 0)[0])


class ChunkOutput(NamedTuple):
    """What a chunk function returns for a chunk of rows."""

    lines: list[str]  # the output lines, without line ends, in input order (any number per row)
    sentences: int  # the rows it translated (or scored): the progress bar's sentences/s
    tokens: int  # the target tokens it generated (or scored): the progress bar's tokens/s


# (index of the chunk's first row in the whole input, counted from 0; the chunk's rows) -> its output.
ChunkFunction = Callable[[int, list[tuple[str, ...]]], ChunkOutput]


@dataclass
class StreamSummary:
    """What a streamed run did (this run only: a resumed run's rows before `resumed_after` are not counted)."""

    rows: int
    sentences: int
    tokens: int
    seconds: float
    resumed_after: int

    def line(self, command: str) -> str:
        """-> the summary line `fastformer <command>` prints."""
        seconds = max(self.seconds, 1e-9)
        resumed = f", resumed after line {self.resumed_after:,}" if self.resumed_after else ""
        lines, sentences = counted(self.rows, "line"), counted(self.sentences, "sentence")
        return (f"fastformer {command}: {lines} ({sentences}{resumed}) in "
                f"{self.seconds:.1f}s: {self.sentences / seconds:,.1f} sentences/s, {self.tokens / seconds:,.0f} "
                f"target tokens/s")


def counted(n: int, noun: str) -> str:
    """-> "1 line", "2,000 lines"."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def progress_path(output: Path) -> Path:
    """The sidecar that records an output file's progress."""
    return output.with_name(output.name + PROGRESS_SUFFIX)


def stream_chunks(inputs: list[LineInput], start: Callable[[], ChunkFunction], output: Path | None,
                  settings: dict[str, object], chunk_lines: int = 2000, resume: bool = False,
                  command: str = "translate", stdout: TextIO | None = None) -> StreamSummary:
    """Runs the inputs' rows through the chunk function that start() returns (called once the first chunk is read,
    so that a bad input or a refused resume fails before a model loads), writing the output lines to `output` (None:
    `stdout`, by default sys.stdout) in input order.

    settings: what shapes the output (JSON values, named as the user gave them), kept in the sidecar; a resumed run
    must give the same. A progress bar (rows, sentences/s, target tokens/s) is drawn on stderr when it is a terminal.
    A run stopped by an error keeps every chunk written before it, and says so on stderr."""
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines must be >= 1, got {chunk_lines}")
    if resume and output is None:
        raise ValueError("resuming needs an output file: standard output cannot be continued")
    if resume and output.exists() and not output.is_file():
        raise ValueError(f"resuming needs an output file: {output} is not a regular file, whose end could be found")
    _check_counts(inputs)
    state, output_hash = _resumable_state(output, settings, inputs) if resume else (None, hashlib.sha256())
    rows = _raw_rows(inputs)
    digest = _RowDigest()
    done = _skip_done(rows, digest, inputs, output, state)
    writer = _Writer(output, state, output_hash, stdout if stdout is not None else sys.stdout)
    summary = StreamSummary(0, 0, 0, 0.0, done)
    process, bar = None, None
    try:
        while chunk := _next_chunk(rows, inputs, chunk_lines):
            digest.update(chunk)
            # Decoded by column, so that a line that is not UTF-8 is named by its input and line.
            columns = [decode_sentences(column, item.name, first=done + 1) for column, item in zip(zip(*chunk), inputs)]
            if process is None:
                process = start()
                # Drawn from here, so that its lines/s leave the model's loading out.
                bar = tqdm(total=inputs[0].count, initial=done, unit="line", desc=command, disable=None,
                           dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
                began = time.perf_counter()
            produced = process(done, list(zip(*columns)))
            writer.write(produced.lines, {"format": PROGRESS_FORMAT, "settings": settings, "rows": done + len(chunk),
                                          "inputs_sha256": digest.hexdigest()})
            done += len(chunk)
            summary.rows += len(chunk)
            summary.sentences += produced.sentences
            summary.tokens += produced.tokens
            summary.seconds = time.perf_counter() - began
            rate = max(summary.seconds, 1e-9)
            bar.set_postfix_str(f"{summary.sentences / rate:,.1f} sentences/s, {summary.tokens / rate:,.0f} tgt tok/s",
                                refresh=False)
            bar.update(len(chunk))
        writer.finish()
    except BaseException:
        writer.close()
        _close(bar)
        if writer.resumable and summary.rows:
            print(f"fastformer {command}: stopped after line {done:,}: {output} holds the output of every line "
                  f"before it, and --resume continues from there", file=sys.stderr)
        raise
    _close(bar)
    return summary


def _next_chunk(rows: Iterator[tuple[bytes, ...]], inputs: list[LineInput],
                chunk_lines: int) -> list[tuple[bytes, ...]]:
    """The next chunk_lines rows, or fewer: at the end, or where an input has no next line ready (after one row)."""
    waits = [item.ready for item in inputs if item.ready is not None]
    if not waits:
        return list(islice(rows, chunk_lines))
    chunk = list(islice(rows, 1))
    while chunk and len(chunk) < chunk_lines and all(ready() for ready in waits):
        row = next(rows, None)
        if row is None:
            break
        chunk.append(row)
    return chunk


def _close(bar: tqdm | None) -> None:
    if bar is not None:
        bar.close()


def _check_counts(inputs: list[LineInput]) -> None:
    """Inputs whose line counts are known must have one count."""
    known = [item for item in inputs if item.count is not None]
    for item in known[1:]:
        if item.count != known[0].count:
            raise ValueError(f"{known[0].name} has {known[0].count} lines but {item.name} has {item.count}: the "
                             f"inputs must be line-aligned")


def _raw_rows(inputs: list[LineInput]) -> Iterator[tuple[bytes, ...]]:
    """The inputs in lockstep -> one tuple of raw lines per row; an input that ends before another raises a
    ValueError naming both."""
    for number, raws in enumerate(zip_longest(*(item.lines for item in inputs))):
        if None in raws:
            short, longer = (inputs[[raw is None for raw in raws].index(ended)] for ended in (True, False))
            raise ValueError(f"{short.name} has {number} lines but {longer.name} has more: the inputs must be "
                             f"line-aligned")
        yield raws


class _RowDigest:
    """A SHA-256 of the rows read, line ends aside (so that a last line that later gets its line end, or CRLF
    files, still match)."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()

    def update(self, rows: list[tuple[bytes, ...]]) -> None:
        for row in rows:
            for raw in row:
                self.hash.update(raw.rstrip(b"\r\n") + b"\n")

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def _skip_done(rows: Iterator[tuple[bytes, ...]], digest: _RowDigest, inputs: list[LineInput], output: Path | None,
               state: dict | None) -> int:
    """Reads the rows a resumed run has done into digest, checking that they are those its output was made from
    -> their number (0 for a fresh run)."""
    if state is None:
        return 0
    done = state["rows"]
    skipped = 0
    while batch := list(islice(rows, min(done - skipped, 1 << 16))):
        digest.update(batch)
        skipped += len(batch)
    if skipped < done:
        raise ValueError(f"{output} holds the output of {done:,} lines, but {inputs[0].name} has only {skipped:,}: "
                         f"it is not the output of this input")
    if digest.hexdigest() != state["inputs_sha256"]:
        names = " and ".join(item.name for item in inputs)
        raise ValueError(f"{output} was not made from {names}: their first {done:,} lines differ from those it was "
                         f"made from")
    return done


def _resumable_state(output: Path, settings: dict[str, object],
                     inputs: list[LineInput]) -> tuple[dict | None, hashlib._Hash]:
    """-> (the sidecar of an interrupted run into `output`, checked against the output file, this run's settings
    and inputs, or None when there is no output file yet: a fresh start; the SHA-256 of the output bytes kept)."""
    sidecar = progress_path(output)
    if not output.exists():
        return None, hashlib.sha256()
    if not sidecar.is_file():
        raise ValueError(f"cannot resume {output}: {sidecar} is missing, so {output} is not the output of an "
                         f"interrupted run (a finished run removes it)")
    try:
        state = json.loads(sidecar.read_text(encoding="utf-8"))
        if not {"format", "settings", "rows", "inputs_sha256", "output_bytes", "output_lines",
                "output_sha256"} <= state.keys():
            raise ValueError("fields are missing")
    except (ValueError, AttributeError) as error:
        raise ValueError(f"cannot resume {output}: {sidecar} is not a progress file ({error})") from None
    if state["format"] != PROGRESS_FORMAT:
        raise ValueError(f"cannot resume {output}: {sidecar} has format {state['format']}, this version writes "
                         f"{PROGRESS_FORMAT}")
    saved = state["settings"]
    for name in sorted(set(saved) | set(settings)):
        if saved.get(name) != settings.get(name):
            raise ValueError(f"cannot resume {output}: it was made with {_setting(name, saved.get(name))}, this run "
                             f"has {_setting(name, settings.get(name))}")
    for item in inputs:
        if item.count is not None and item.count < state["rows"]:
            raise ValueError(f"{output} holds the output of {state['rows']:,} lines, but {item.name} has only "
                             f"{item.count:,}: it is not the output of this input")
    size = output.stat().st_size
    if size < state["output_bytes"]:
        raise ValueError(f"cannot resume {output}: it has {size:,} bytes, fewer than the {state['output_bytes']:,} "
                         f"{sidecar} records: it was changed after the run stopped")
    output_hash = hashlib.sha256()
    with open(output, "rb") as file:
        lines = _count_newlines(file, state["output_bytes"], output_hash)
    if lines != state["output_lines"] or output_hash.hexdigest() != state["output_sha256"]:
        raise ValueError(f"cannot resume {output}: its first {state['output_bytes']:,} bytes are not those {sidecar} "
                         f"records (their lines or their SHA-256 differ): it was changed after the run stopped")
    return state, output_hash


def _setting(name: str, value: object) -> str:
    """A setting as a command line gives it: "--beam 4", "--print-alignment", "no --prefix-file"."""
    if value is None or value is False:
        return f"no {name}"
    return name if value is True else f"{name} {value}"


def _count_newlines(file: BinaryIO, size: int, digest: hashlib._Hash) -> int:
    """-> the line ends in the file's first `size` bytes, which also go into digest."""
    count = 0
    while size > 0 and (block := file.read(min(size, 1 << 22))):
        count += block.count(b"\n")
        digest.update(block)
        size -= len(block)
    return count


class _Writer:
    """Writes each chunk's output lines, then (to a regular file) syncs it and records the progress in the sidecar.
    output_hash: the SHA-256 of the output bytes kept (a resumed run's, else of none)."""

    def __init__(self, output: Path | None, state: dict | None, output_hash: hashlib._Hash, stdout: TextIO) -> None:
        self.output = output
        self.stdout = stdout
        self.state = state
        self.output_hash = output_hash
        # /dev/null or a pipe: no end to find again (fsync refuses it), so no sidecar.
        self.resumable = output is not None and (not output.exists() or output.is_file())
        self.file: BinaryIO | None = None
        self.bytes = state["output_bytes"] if state else 0
        self.lines = state["output_lines"] if state else 0

    def _open(self) -> BinaryIO:
        """Opens the output at the first write (a run that fails before writing leaves an old output as it was):
        cut back to the last chunk its sidecar records when resuming, else emptied and its stale sidecar removed."""
        if self.state is None:
            if self.resumable:
                progress_path(self.output).unlink(missing_ok=True)
            return open(self.output, "wb")
        file = open(self.output, "r+b")
        file.truncate(self.bytes)
        file.seek(self.bytes)
        return file

    def write(self, lines: list[str], progress: dict) -> None:
        data = "".join(line + "\n" for line in lines)
        if self.output is None:
            self.stdout.write(data)
            self.stdout.flush()
            return
        if self.file is None:
            self.file = self._open()
        encoded = data.encode("utf-8")
        self.file.write(encoded)
        self.file.flush()
        if not self.resumable:
            return
        os.fsync(self.file.fileno())
        self.bytes += len(encoded)
        self.lines += len(lines)
        self.output_hash.update(encoded)
        sidecar = progress_path(self.output)
        temporary = sidecar.with_name(sidecar.name + ".tmp")
        temporary.write_text(json.dumps({**progress, "output_bytes": self.bytes, "output_lines": self.lines,
                                         "output_sha256": self.output_hash.hexdigest()}), encoding="utf-8")
        os.replace(temporary, sidecar)

    def finish(self) -> None:
        """Closes the output (created, empty, if nothing was written) and removes its sidecar: the run is complete."""
        if self.output is None:
            return
        if self.file is None:
            self.file = self._open()
        self.close()
        if self.resumable:
            progress_path(self.output).unlink(missing_ok=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
