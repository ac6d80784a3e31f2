"""Translator's n-best results from text, and `fastformer translate` streaming files: chunked, in input order, JSON
lines, a progress bar, --resume after a failure; the streaming runner's memory bound on a counted iterator."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fastformer
from fastformer import checkpoint
from fastformer.__main__ import main
from fastformer.data import BUNDLED_CORPUS, EOS_ID, read_lines, train_tokenizer
from fastformer.decoding.alignment import hard_alignment
from fastformer.translation import streaming
from fastformer.translation import translator as translator_module
from fastformer.translation.streaming import ChunkOutput, LineInput, StreamSummary, progress_path, stream_chunks
from fastformer.translation.translator import BLANK, TranslationResult
from fastformer_process import start

pytestmark = pytest.mark.usefixtures("one_thread")

# Blank lines among them, to keep their places; the random model's translations run to its length limit, so the
# sentences are short.
LINES = read_lines(BUNDLED_CORPUS / "test.en")[:4] + [""] + read_lines(BUNDLED_CORPUS / "test.en")[4:9] + ["  "]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, fastformer.Translator]:
    """A random tiny model with a small trained tokenizer, saved as `fastformer train` saves -> (its path, its
    Translator on the CPU)."""
    sentences = read_lines(BUNDLED_CORPUS / "valid.en")[:200] + read_lines(BUNDLED_CORPUS / "valid.de")[:200]
    tokenizer = train_tokenizer(sentences, vocab_size=120)
    torch.manual_seed(0)
    model = fastformer.Transformer(fastformer.TransformerConfig.tiny(tokenizer.vocab_size, dropout=0.0)).eval()
    path = tmp_path_factory.mktemp("tiny") / "checkpoint.pt"
    checkpoint.save_checkpoint(checkpoint.Checkpoint(model=model.state_dict(), config=model.config.to_dict(),
                                                     tokenizer=tokenizer.model_proto), path)
    return path, fastformer.load_translator(path, device="cpu")


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _lines(path: Path) -> list[str]:
    """An output file's lines, blank ones kept (read_lines refuses them)."""
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def _translate(path: Path, *options: str) -> None:
    main(["translate", "--checkpoint", str(path), "--device", "cpu", *options])


def test_n_best_results_are_the_searchs_hypotheses_of_each_sentence_alone(tiny):
    """n_best=3, return_scores: per sentence the hypotheses Transformer.translate gives it alone (tokens as pieces,
    the text decoded from them, the same scores); a blank line keeps its place with BLANK; the defaults return the
    best texts."""
    _, translator = tiny
    found = translator.translate(LINES, beam_size=4, n_best=3, return_scores=True)
    tokenizer = translator.target_tokenizer
    for line, results in zip(LINES, found):
        if not line.strip():
            assert results == [BLANK]
            continue
        src = torch.tensor([translator.source_tokenizer.encode([line])[0] + [EOS_ID]])
        expected = translator.model.translate(src, beam_size=4, n_best=3)[0]
        assert [result.tokens for result in results] == [tokenizer.pieces(h.tokens) for h in expected]
        assert [result.text for result in results] == tokenizer.decode([h.tokens for h in expected])
        torch.testing.assert_close(torch.tensor([result.score for result in results]),
                                   torch.tensor([h.score for h in expected]))
        assert all(isinstance(result, TranslationResult) and result.attention is None for result in results)
    assert translator.translate(LINES, beam_size=4) == [results[0].text for results in found]
    scored = translator.translate(LINES, beam_size=4, return_scores=True)
    assert [[result.text for result in results] for results in scored] == [[results[0].text] for results in found]
    with pytest.raises(ValueError, match="target_prefix has 1 entries for 11 sentences"):
        translator.translate(LINES, target_prefix=["Der"])


def test_text_prefixes_are_the_target_tokenizers_ids(tiny):
    _, translator = tiny
    prefixes = ["Der alte", None, "", "Die"] + [None] * (len(LINES) - 4)
    found = translator.translate(LINES, beam_size=2, target_prefix=prefixes)
    for line, prefix, text in zip(LINES, prefixes, found):
        if not line.strip():  # a blank line is not translated, whatever its prefix
            assert text == ""
            continue
        src = torch.tensor([translator.source_tokenizer.encode([line])[0] + [EOS_ID]])
        ids = translator.target_tokenizer.encode([prefix])[0] if prefix else None
        best = translator.model.translate(src, beam_size=2, target_prefix=[ids])[0][0]
        assert text == translator.target_tokenizer.decode([best.tokens])[0]


def test_jsonl_n_best_in_chunks_is_translators_results(tiny, tmp_path, monkeypatch, capsys):
    """--output-format jsonl --n-best 2 over chunks of 3 lines: one object per hypothesis in input order, line and
    rank from 0, text and score as Translator.translate gives them; a blank line gives one object, empty, no score."""
    path, translator = tiny
    source, output = _write(tmp_path / "in.en", LINES), tmp_path / "out.jsonl"
    summaries = []
    monkeypatch.setattr("fastformer.__main__.stream_chunks",
                        lambda *args, **kwargs: summaries.append(stream_chunks(*args, **kwargs)) or summaries[-1])
    _translate(path, "--input", str(source), "--output", str(output), "--output-format", "jsonl", "--n-best", "2",
               "--beam", "3", "--chunk-lines", "3")
    records = [json.loads(line) for line in _lines(output)]
    expected = translator.translate(LINES, beam_size=3, n_best=2, return_scores=True)
    assert records == [{"line": line, "rank": rank, "text": result.text, "score": result.score}
                       for line, results in enumerate(expected) for rank, result in enumerate(results)]
    assert [record["line"] for record in records if record["text"] == ""] == [4, 10]
    assert not progress_path(output).exists()  # a finished run removes its progress file
    translated = [results for line, results in zip(LINES, expected) if line.strip()]
    summary = summaries[0]
    assert (summary.rows, summary.sentences, summary.resumed_after) == (11, 9, 0)
    assert summary.tokens == sum(len(result.tokens) + 1 for results in translated for result in results)
    assert capsys.readouterr().err.splitlines()[-1] == summary.line("translate")
    assert summary.line("translate").startswith("fastformer translate: 11 lines (9 sentences) in ")


def test_text_output_in_chunks_from_stdin_keeps_order_and_blank_lines(tiny, monkeypatch, capsys):
    path, translator = tiny
    expected = translator.translate(LINES, beam_size=4)
    for chunk_lines in ("1", "4", "2000"):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("".join(f"{s}\n" for s in LINES).encode())))
        _translate(path, "--chunk-lines", chunk_lines)
        assert capsys.readouterr().out.split("\n") == expected + [""]


def test_text_with_n_best_and_a_resume_without_output_are_refused(tiny, tmp_path):
    path, _ = tiny
    source = _write(tmp_path / "in.en", LINES)
    with pytest.raises(SystemExit, match=r"^fastformer translate: error: --n-best 2 gives several translations per "
                                         r"line: use --output-format jsonl$"):
        _translate(path, "--input", str(source), "--n-best", "2", "--beam", "2")
    with pytest.raises(SystemExit, match="--resume needs --output"):
        _translate(path, "--input", str(source), "--resume")
    with pytest.raises(SystemExit, match=r"error: --sampling-topk 5 draws with --beam 1 \(the default when sampling\); "
                                         r"--beam 4 would make it a stochastic beam search"):
        _translate(path, "--input", str(source), "--sampling-topk", "5", "--beam", "4")
    with pytest.raises(SystemExit, match="--chunk-lines must be >= 1, got 0"):
        _translate(path, "--input", str(source), "--chunk-lines", "0")
    with pytest.raises(SystemExit, match=f"checkpoint not found: {tmp_path / 'absent.pt'}"):
        main(["translate", "--checkpoint", str(tmp_path / "absent.pt"), "--input", str(source)])


def test_prefix_file_of_another_length_is_refused_before_any_work(tiny, tmp_path, monkeypatch):
    path, _ = tiny
    source, prefixes = _write(tmp_path / "in.en", LINES), _write(tmp_path / "prefixes.de", ["Der"] * 3)
    monkeypatch.setattr("fastformer.__main__.load_translator", None)  # loading a model would fail the test
    with pytest.raises(SystemExit, match=f"{source} has 11 lines but {prefixes} has 3: the inputs must be "
                                         "line-aligned"):
        _translate(path, "--input", str(source), "--prefix-file", str(prefixes))


def test_a_non_utf8_line_in_a_later_chunk_is_named_by_its_line(tiny, tmp_path, capsys):
    path, translator = tiny
    source, output = tmp_path / "in.en", tmp_path / "out.de"
    source.write_bytes("".join(f"{line}\n" for line in LINES[:4]).encode() + "Gr\u00fc\u00dfe.\n".encode("latin-1"))
    with pytest.raises(SystemExit, match=rf"^fastformer translate: error: {source}:5: not valid UTF-8"):
        _translate(path, "--input", str(source), "--output", str(output), "--chunk-lines", "2")
    assert _lines(output) == translator.translate(LINES[:4])  # chunks 1-2 are kept
    assert "stopped after line 4" in capsys.readouterr().err


def _fail_on_call(monkeypatch, failing_call: int, error: BaseException = OSError("disk on fire")) -> None:
    """Translator.hypotheses (one call per chunk) raises error on its failing_call-th call."""
    real = translator_module.Translator.hypotheses
    calls = []

    def hypotheses(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == failing_call:
            raise error
        return real(self, *args, **kwargs)
    monkeypatch.setattr(translator_module.Translator, "hypotheses", hypotheses)


@pytest.mark.parametrize("output_format", ["text", "jsonl"])
def test_a_failure_keeps_the_chunks_written_and_resume_finishes_as_one_run_would(tiny, tmp_path, monkeypatch,
                                                                                capsys, output_format):
    """A failure in the 3rd chunk leaves chunks 1-2 in the output; --resume (with another chunk size) translates
    the rest, and the output is byte for byte that of an uninterrupted run. jsonl with --n-best 2 writes several
    lines per input line: the progress file, not a count of lines, says where to go on."""
    path, _ = tiny
    source = _write(tmp_path / "in.en", LINES)
    options = ["--input", str(source), "--output-format", output_format, "--beam", "2"]
    options += ["--n-best", "2"] if output_format == "jsonl" else []
    whole, output = tmp_path / "whole", tmp_path / "out"
    _translate(path, *options, "--output", str(whole))
    with monkeypatch.context() as patched:
        _fail_on_call(patched, 3)
        with pytest.raises(SystemExit, match="error: disk on fire"):
            _translate(path, *options, "--output", str(output), "--chunk-lines", "3")
    assert "stopped after line 6:" in capsys.readouterr().err
    kept = output.read_bytes()
    lines_per_input = 2 if output_format == "jsonl" else 1
    expected_kept = whole.read_bytes().splitlines(keepends=True)[:6 * lines_per_input - (output_format == "jsonl")]
    assert kept == b"".join(expected_kept)  # line 4 is blank: one jsonl object
    progress = json.loads(progress_path(output).read_text())
    assert progress["rows"] == 6 and progress["output_bytes"] == len(kept)
    with output.open("ab") as file:  # a chunk cut off mid-write
        file.write(b'half a li')
    _translate(path, *options, "--output", str(output), "--chunk-lines", "4", "--resume")
    assert output.read_bytes() == whole.read_bytes()
    assert not progress_path(output).exists()
    assert "resumed after line 6" in capsys.readouterr().err.splitlines()[-1]


def test_ctrl_c_keeps_the_chunks_written_and_exits_without_a_traceback(tiny, tmp_path, monkeypatch, capsys):
    path, translator = tiny
    source, output = _write(tmp_path / "in.en", LINES), tmp_path / "out.de"
    _fail_on_call(monkeypatch, 2, KeyboardInterrupt())
    with pytest.raises(SystemExit) as stopped:
        _translate(path, "--input", str(source), "--output", str(output), "--chunk-lines", "5")
    assert stopped.value.code == 130
    assert capsys.readouterr().err == (f"fastformer translate: stopped after line 5: {output} holds the output of "
                                       f"every line before it, and --resume continues from there\n")
    assert _lines(output) == translator.translate(LINES[:5])


def test_a_failed_write_names_the_last_line_written(tiny, tmp_path, monkeypatch, capsys):
    """A full disk in the 3rd chunk's write: the stop line and the progress file both say 6 lines, and --resume
    finishes the output as one run would."""
    path, _ = tiny
    source, whole, output = _write(tmp_path / "in.en", LINES), tmp_path / "whole.de", tmp_path / "out.de"
    _translate(path, "--input", str(source), "--output", str(whole))
    real, calls = streaming._Writer.write, []

    def write(self, lines, progress):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(self, lines, progress)
    with monkeypatch.context() as patched:
        patched.setattr(streaming._Writer, "write", write)
        with pytest.raises(SystemExit, match="No space left on device"):
            _translate(path, "--input", str(source), "--output", str(output), "--chunk-lines", "3")
    assert "stopped after line 6:" in capsys.readouterr().err
    assert json.loads(progress_path(output).read_text())["rows"] == 6
    _translate(path, "--input", str(source), "--output", str(output), "--resume")
    assert output.read_bytes() == whole.read_bytes()


def test_sigterm_keeps_the_chunks_written_and_says_where_it_stopped(tiny, tmp_path, monkeypatch, capsys):
    """A job scheduler's SIGTERM mid-run ends it as Ctrl-C does: the chunks written kept, the line to resume after
    said, exit status 143."""
    path, translator = tiny
    source, output = _write(tmp_path / "in.en", LINES), tmp_path / "out.de"
    real, calls = translator_module.Translator.hypotheses, []

    def terminated_in_the_second_chunk(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(translator_module.Translator, "hypotheses", terminated_in_the_second_chunk)

    def unhandled(signum, frame):  # where the command keeps the default action, which would end pytest
        raise AssertionError("translate left SIGTERM to the process's own handler")
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as stopped:
            _translate(path, "--input", str(source), "--output", str(output), "--chunk-lines", "5")
        assert signal.getsignal(signal.SIGTERM) is unhandled, "the command gives the handler it found back"
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    assert capsys.readouterr().err.startswith("fastformer translate: stopped after line 5:")
    assert _lines(output) == translator.translate(LINES[:5])


def test_a_reader_that_leaves_ends_the_run_quietly(tiny, tmp_path):
    """`translate ... | head -1`: once the reader has gone, the next chunk's write ends the run with SIGPIPE's status
    and nothing on stderr, as Unix tools end (it said "error: [Errno 32] Broken pipe" and exited 1)."""
    path, translator = tiny
    source = _write(tmp_path / "in.en", LINES * 20)
    process = start(["translate", "--checkpoint", str(path), "--device", "cpu", "--input", str(source),
                     "--chunk-lines", "2"], tmp_path, tmp_path / "stderr.txt")
    assert process.stdout.readline() == translator.translate(LINES[:1])[0] + "\n"
    process.stdout.close()
    assert process.wait(timeout=120) == 128 + signal.SIGPIPE
    assert (tmp_path / "stderr.txt").read_text() == ""


def test_an_allocation_too_large_is_one_line_naming_what_to_lower(tiny, tmp_path):
    """A mistyped --beam 1000000000 asks the allocator for terabytes: one line, not torch's traceback."""
    path, _ = tiny
    source = _write(tmp_path / "in.en", LINES[:1])
    with pytest.raises(SystemExit, match=r"^fastformer translate: error: out of memory \(.*can't allocate memory.*\): "
                                         r"a smaller --batch-tokens, or --beam, needs less$"):
        _translate(path, "--input", str(source), "--beam", "1000000000")


def _interrupted(tiny, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A run stopped in its 2nd chunk of 3 lines -> (its input, its output)."""
    path, _ = tiny
    source, output = _write(tmp_path / "in.en", LINES), tmp_path / "out.de"
    with monkeypatch.context() as patched:
        _fail_on_call(patched, 2)
        with pytest.raises(SystemExit):
            _translate(path, "--input", str(source), "--output", str(output), "--chunk-lines", "3")
    return source, output


def test_resume_refuses_outputs_that_are_not_this_inputs(tiny, tmp_path, monkeypatch):
    """Each refusal is one line, made before any model loads."""
    path, _ = tiny
    source, output = _interrupted(tiny, tmp_path, monkeypatch)
    monkeypatch.setattr("fastformer.__main__.load_translator", None)
    resume = ["--output", str(output), "--chunk-lines", "3", "--resume"]

    def refused(pattern: str, *options: str) -> None:
        with pytest.raises(SystemExit, match=rf"^fastformer translate: error: {pattern}"):
            _translate(path, *options, *resume)

    refused(f"cannot resume {output}: it was made with --beam 4, this run has --beam 5", "--input", str(source),
            "--beam", "5")
    refused(f"cannot resume {output}: it was made with no --print-alignment, this run has --print-alignment",
            "--input", str(source), "--print-alignment")
    # Another model at the same path (an `average` written over it, say).
    saved = path.read_bytes()
    try:
        replaced = checkpoint.load_checkpoint(path)
        replaced.model = {name: tensor * 1.5 for name, tensor in replaced.model.items()}
        checkpoint.save_checkpoint(replaced, path)
        refused(f"cannot resume {output}: it was made with the checkpoint's SHA-256 ", "--input", str(source))
    finally:
        path.write_bytes(saved)
    short = _write(tmp_path / "short.en", LINES[:2])
    refused(f"{output} holds the output of 3 lines, but {short} has only 2: it is not the output of this input",
            "--input", str(short))
    changed = _write(tmp_path / "changed.en", [LINES[0], LINES[2], LINES[1]] + LINES[3:])
    refused(f"{output} was not made from {changed}: their first 3 lines differ", "--input", str(changed))
    kept = output.read_bytes()
    output.write_bytes(kept[:-1])
    refused(f"cannot resume {output}: it has {len(kept) - 1} bytes, fewer than the {len(kept)}", "--input",
            str(source))
    changed_bytes = f"cannot resume {output}: its first {len(kept)} bytes are not those {progress_path(output)} records"
    output.write_bytes(kept.replace(b"\n", b" ", 1) + b"\n")
    refused(changed_bytes, "--input", str(source))
    # Edited in place, the same bytes and lines (as `sed -i` can leave it).
    output.write_bytes(kept.replace(kept[:1], b"#" if kept[:1] != b"#" else b"%", 1))
    refused(changed_bytes, "--input", str(source))
    progress_path(output).unlink()
    refused(f"cannot resume {output}: {progress_path(output)} is missing", "--input", str(source))


def test_resume_without_an_output_starts_afresh_and_a_run_without_resume_overwrites(tiny, tmp_path, monkeypatch):
    path, translator = tiny
    source, output = _interrupted(tiny, tmp_path, monkeypatch)
    expected = translator.translate(LINES)
    _translate(path, "--input", str(source), "--output", str(output))
    assert _lines(output) == expected and not progress_path(output).exists()
    fresh = tmp_path / "fresh.de"
    _translate(path, "--input", str(source), "--output", str(fresh), "--resume")
    assert _lines(fresh) == expected


def test_progress_bar_on_a_terminal_shows_lines_and_rates(tiny, tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    path, _ = tiny
    source, terminal = _write(tmp_path / "in.en", LINES), Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    _translate(path, "--input", str(source), "--output", str(tmp_path / "out.de"), "--chunk-lines", "5")
    drawn = terminal.getvalue()
    assert "translate: 100%" in drawn and "11/11" in drawn
    assert "sentences/s" in drawn and "tgt tok/s" in drawn


class _CountedLines:
    """An input's raw lines, counting how many have been read."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.read = 0

    def __iter__(self) -> Iterator[bytes]:
        for number in range(self.count):
            self.read += 1
            yield f"line {number}\n".encode()


def test_the_runner_holds_one_chunk_of_input_at_a_time(tmp_path):
    """Whenever the chunk function runs, exactly the lines of the chunks so far have been read from each input (none
    ahead), a chunk has at most chunk_lines rows, and the output is every row's lines in order."""
    sources, targets = _CountedLines(1000), _CountedLines(1000)
    seen = []

    def process(first: int, rows: list[tuple[str, ...]]) -> ChunkOutput:
        assert sources.read == targets.read == first + len(rows) and len(rows) <= 64
        seen.append(len(rows))
        return ChunkOutput([f"{source}|{target}" for source, target in rows], len(rows), 0)

    output = tmp_path / "out"
    summary = stream_chunks([LineInput("sources", sources), LineInput("targets", targets, 1000)], lambda: process,
                            output, {}, chunk_lines=64)
    assert seen == [64] * 15 + [40]
    assert _lines(output) == [f"line {i}|line {i}" for i in range(1000)]
    assert (summary.rows, summary.sentences, summary.resumed_after) == (1000, 1000, 0)


def test_the_summary_counts_one_line_and_one_sentence_in_the_singular():
    assert StreamSummary(1, 1, 9, 0.5, 0).line("score").startswith("fastformer score: 1 line (1 sentence) in 0.5s: ")
    assert StreamSummary(2000, 1, 9, 0.5, 1).line("translate").startswith(
        "fastformer translate: 2,000 lines (1 sentence, resumed after line 1) in ")


@pytest.mark.parametrize("ending", [b"", b"\n"])
def test_stdin_lines_are_the_bytes_lines_whatever_the_reads(ending):
    """StdinLines against bytes.splitlines: lines split across reads, empty ones, one longer than a read (1 MiB) and
    the last without its line end; the pipe is written in pieces of random sizes by a thread."""
    generator = torch.Generator().manual_seed(0)
    lines = [b"a" * int(n) for n in torch.randint(0, 300, (400,), generator=generator)]
    data = b"\n".join(lines[:200] + [b"", b"x" * (3 << 20)] + lines[200:]) + ending
    cuts = sorted(torch.randint(0, len(data), (300,), generator=generator).tolist()) + [len(data)]
    read_end, write_end = os.pipe()

    def write() -> None:
        with os.fdopen(write_end, "wb") as pipe:
            start = 0
            for cut in cuts:
                pipe.write(data[start:cut])
                pipe.flush()
                start = cut
    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert list(streaming.StdinLines(read_end)) == data.splitlines(keepends=True)
    finally:
        writer.join()
        os.close(read_end)


def test_the_runner_names_an_input_that_ends_first(tmp_path):
    with pytest.raises(ValueError, match="^targets has 5 lines but sources has more: the inputs must be line-aligned"):
        stream_chunks([LineInput("sources", _CountedLines(8)), LineInput("targets", _CountedLines(5))],
                      lambda: lambda first, rows: ChunkOutput([], 0, 0), tmp_path / "out", {}, chunk_lines=3)


def test_search_options_and_text_prefixes_reach_the_search(tiny, tmp_path, monkeypatch):
    """The CLI's search flags arrive in Transformer.translate by CTranslate2's names (their defaults when not given),
    --prefix-file's lines as the target tokenizer's ids of each batch's sentences (None for an empty line; none at
    all where no line has a prefix)."""
    path, translator = tiny
    calls = []
    real = fastformer.Transformer.translate

    def spy(self, src, **options):
        calls.append((src, options))
        return real(self, src, **options)
    monkeypatch.setattr(fastformer.Transformer, "translate", spy)
    prefixes = ["Der alte", "", "Die"] + [""] * (len(LINES) - 3)
    source, prefix_file = _write(tmp_path / "in.en", LINES), _write(tmp_path / "prefixes.de", prefixes)
    _translate(path, "--input", str(source), "--output", str(tmp_path / "out.de"), "--chunk-lines", "4")
    defaults = dict(beam_size=4, sampling_topk=1, sampling_topp=1.0, sampling_temperature=1.0, seed=0,
                    no_repeat_ngram_size=0, repetition_penalty=1.0, target_prefix=None, return_attention=False)
    assert calls and all(options.items() >= defaults.items() for _, options in calls)
    calls.clear()
    _translate(path, "--input", str(source), "--output", str(tmp_path / "sampled.de"), "--beam", "1", "--n-best", "1",
               "--sampling-topk", "5", "--sampling-topp", "0.9", "--sampling-temperature", "0.7", "--seed", "3",
               "--no-repeat-ngram-size", "2", "--repetition-penalty", "1.2", "--prefix-file", str(prefix_file),
               "--chunk-lines", "4")
    given = dict(sampling_topk=5, sampling_topp=0.9, sampling_temperature=0.7, seed=3, no_repeat_ngram_size=2,
                 repetition_penalty=1.2)
    assert all(options.items() >= given.items() for _, options in calls)
    expected = {tuple(ids + [EOS_ID]): translator.target_tokenizer.encode([prefix])[0] if prefix else None
                for ids, prefix in zip(translator.source_tokenizer.encode(LINES), prefixes) if ids}
    found = {tuple(row[row != 0].tolist()): prefix for src, options in calls
             for row, prefix in zip(src, options["target_prefix"] or [None] * len(src))}
    assert found == expected


def test_sampled_n_best_is_the_same_in_any_chunks(tiny, tmp_path):
    """--sampling-topk 5 --n-best 3: three samples per line, as Translator.translate gives them, whatever the chunks
    the lines fall in (each sentence's samples depend on the seed and its tokens only), with --beam 1 given or not
    (its default when sampling)."""
    path, translator = tiny
    source = _write(tmp_path / "in.en", LINES)
    sampling = ["--sampling-topk", "5", "--n-best", "3", "--seed", "7", "--output-format", "jsonl"]
    for chunk_lines, beam in (("2", []), ("2000", ["--beam", "1"])):
        _translate(path, "--input", str(source), "--output", str(tmp_path / chunk_lines), "--chunk-lines", chunk_lines,
                   *sampling, *beam)
    assert _lines(tmp_path / "2") == _lines(tmp_path / "2000")
    expected = translator.translate(LINES, beam_size=1, sampling_topk=5, n_best=3, seed=7, return_scores=True)
    assert [json.loads(line)["text"] for line in _lines(tmp_path / "2")] == [
        result.text for results in expected for result in results]


def test_print_alignment_writes_fairseqs_pairs_from_the_attention(tiny, tmp_path):
    """text: the best translation, a tab, hard_alignment's "i-j" pairs of its attention; jsonl: an "alignment" field
    per hypothesis; a blank line has none."""
    path, translator = tiny
    source = _write(tmp_path / "in.en", LINES)
    _translate(path, "--input", str(source), "--output", str(tmp_path / "out.txt"), "--print-alignment")
    _translate(path, "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--print-alignment",
               "--output-format", "jsonl", "--n-best", "2")
    expected = translator.translate(LINES, n_best=2, return_attention=True)

    def pairs(result: TranslationResult) -> str:
        if result.attention is None:
            return ""
        found = hard_alignment(result.attention, result.attention.shape[1] - 1, len(result.tokens))
        return " ".join(f"{i}-{j}" for i, j in found)
    assert _lines(tmp_path / "out.txt") == [f"{results[0].text}\t{pairs(results[0])}" for results in expected]
    assert [json.loads(line)["alignment"] for line in _lines(tmp_path / "out.jsonl")] == [
        pairs(result) for results in expected for result in results]
    assert [results[0].attention is None for results in expected] == [not line.strip() for line in LINES]


def test_outputs_and_inputs_it_cannot_take_are_refused_before_any_work(tiny, tmp_path, monkeypatch):
    path, _ = tiny
    source = _write(tmp_path / "in.en", LINES)
    monkeypatch.setattr("fastformer.__main__.load_translator", None)

    def refused(pattern: str, *options: str, command: str = "translate") -> None:
        with pytest.raises(SystemExit, match=rf"^fastformer {command}: error: {pattern}"):
            main([command, "--checkpoint", str(path), "--device", "cpu", *options])

    refused(f"--output {source} is --input {source}, which this command reads: writing it would destroy it",
            "--input", str(source), "--output", str(source))
    other = _write(tmp_path / "other.en", LINES)
    refused(f"--output {source} is --targets {source}", "--input", str(other), "--targets", str(source), "--output",
            str(source), command="score")
    refused(f"--output {path} is --checkpoint {path}", "--input", str(source), "--output", str(path))
    refused("--output out.de.gz ends in .gz", "--input", str(source), "--output", "out.de.gz")
    refused(f"--output {tmp_path / 'absent' / 'out.de'}: its directory does not exist", "--input", str(source),
            "--output", str(tmp_path / "absent" / "out.de"))
    refused(f"--output {tmp_path} is a directory", "--input", str(source), "--output", str(tmp_path))
    with open(source, "rb") as same:  # `--output F < F`
        monkeypatch.setattr("sys.stdin", same)
        refused(f"--output {source} is standard input /dev/fd/{same.fileno()}, which this command reads", "--output",
                str(source))
        refused("--input and --targets both read standard input", "--targets", "-", command="score")
    assert source.read_text(encoding="utf-8") == "".join(line + "\n" for line in LINES)
    blanks = _write(tmp_path / "blanks.en", ["", " "])
    refused("beam_size must be >= 1, got 0", "--input", str(blanks), "--beam", "0", "--output",
            str(tmp_path / "o.de"))
    refused("--sampling-topp and --sampling-temperature shape sampling", "--input", str(blanks), "--sampling-topp",
            "0.5")
    assert not (tmp_path / "o.de").exists() and not progress_path(tmp_path / "o.de").exists()


def test_a_pipe_in_and_dev_null_out_translate(tiny, tmp_path, capsys):
    """An input that is a pipe (as `<(zcat f.gz)` gives one) is read once, uncounted; /dev/null takes the output
    without the progress sidecar (and its sync) a file gets."""
    path, translator = tiny
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    feeder = threading.Thread(target=lambda: _write(pipe, LINES[:3]))
    feeder.start()
    _translate(path, "--input", str(pipe), "--beam", "1")
    feeder.join()
    assert capsys.readouterr().out.splitlines() == translator.translate(LINES[:3], beam_size=1)
    _translate(path, "--input", str(_write(tmp_path / "in.en", LINES[:3])), "--beam", "1", "--output", "/dev/null")
    assert "3 lines" in capsys.readouterr().err


def test_a_dash_is_standard_input_and_output(tiny, tmp_path, monkeypatch, capsys):
    path, translator = tiny
    with open(_write(tmp_path / "in.en", LINES[:3]), "rb") as source:
        monkeypatch.setattr("sys.stdin", source)
        _translate(path, "--input", "-", "--output", "-", "--beam", "1")
    assert capsys.readouterr().out.splitlines() == translator.translate(LINES[:3], beam_size=1)
    assert not (tmp_path / "-").exists() and not Path("-").exists()


def test_standard_input_gets_each_line_answered_before_the_next_comes(tiny, tmp_path):
    """A program that writes a line to `fastformer translate` and waits reads its translation (as from
    fairseq-interactive): a chunk ends where standard input has no further line yet."""
    path, translator = tiny
    process = start(["translate", "--checkpoint", str(path), "--device", "cpu", "--beam", "1"], tmp_path,
                    tmp_path / "stderr", stdin=subprocess.PIPE)
    try:
        for line in LINES[:2]:
            process.stdin.write(line + "\n")
            process.stdin.flush()
            assert select.select([process.stdout], [], [], 120)[0], (tmp_path / "stderr").read_text()
            assert process.stdout.readline() == translator.translate([line], beam_size=1)[0] + "\n"
        process.stdin.close()
        assert process.wait(timeout=60) == 0, (tmp_path / "stderr").read_text()
    finally:
        process.kill()


def test_a_prefix_too_long_is_named_by_its_line(tiny, tmp_path):
    path, _ = tiny
    sources = _write(tmp_path / "in.en", ["Hallo."] * 12)
    prefixes = _write(tmp_path / "prefix.de", ["Hallo"] * 9 + [" ".join(["Haus"] * 80)] + ["Hallo"] * 2)
    with pytest.raises(SystemExit, match=r"^fastformer translate: error: line 10: the target prefix has \d+ tokens, "
                                         r"more than its length limit"):
        _translate(path, "--input", str(sources), "--prefix-file", str(prefixes), "--chunk-lines", "5", "--output",
                   str(tmp_path / "out.de"))


def test_texts_the_translator_cannot_take_are_named(tiny):
    """A str for a list, text of no tokens (a zero-width space: translated as a blank line is, refused by score),
    and text that is not valid Unicode (a lone surrogate, which the tokenizer refuses) are each named."""
    _, translator = tiny
    with pytest.raises(TypeError, match="sentences must be a list of texts, one per sentence, not a str"):
        translator.translate("Hello.")
    with pytest.raises(TypeError, match="targets must be a list of texts"):
        translator.score(["Hello."], "Hallo.")
    assert translator.translate(["\u200b", LINES[0]]) == ["", translator.translate([LINES[0]])[0]]
    with pytest.raises(ValueError, match="^line 2: the source has no tokens"):
        translator.score([LINES[0], "\u200b"], ["Hallo."] * 2)
    with pytest.raises(ValueError, match=r"^line 3: the source is not valid Unicode text \(surrogates not allowed at "
                                         r"character 1\)"):
        translator.translate([LINES[0], "", "a\ud800"])
    with pytest.raises(ValueError, match="^line 1: the target is not valid Unicode text"):
        translator.score(["Hallo."], ["\udc80"])


def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_one_line(tiny, tmp_path):
    path, _ = tiny
    saved = checkpoint.load_checkpoint(path)
    saved.config["d_ff"] *= 2
    checkpoint.save_checkpoint(saved, tmp_path / "misfit.pt")
    with pytest.raises(ValueError) as error:
        fastformer.load_translator(tmp_path / "misfit.pt", device="cpu")
    assert str(error.value).startswith(f"{tmp_path / 'misfit.pt'} does not hold a usable model: Error(s) in loading "
                                       "state_dict for Transformer: size mismatch for ")
    assert "\n" not in str(error.value) and str(error.value).endswith(" more)")
