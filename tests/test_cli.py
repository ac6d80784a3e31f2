"""The inference commands: translate (stdin to stdout, files), evaluate (sacreBLEU with signatures), their errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import sacrebleu
import torch

from fastformer import checkpoint
from fastformer.__main__ import build_parser
from fastformer.data import BUNDLED_CORPUS, EOS_ID, read_lines
from fastformer.translation import evaluate
from fastformer.translation.translator import load_checkpoint_model, load_translator
from fastformer_process import run

SENTENCES = ["The dog sees a cat.", "My friend reads the new book today.", "Do you play in the garden?",
             "Two old men sleep."]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny model trained a few hundred steps on the bundled corpus -> its run directory. Everything here runs on
    the CPU, so that the CLI's output can be compared with the in-process oracle exactly."""
    out_dir = tmp_path_factory.mktemp("cli") / "run"
    done = run(["train", "--device", "cpu", "--out-dir", str(out_dir), "--vocab-size", "300", "--batch-tokens", "1500",
                "--update-tokens", "1500", "--warmup", "100", "--lr-scale", "2", "--max-steps", "150", "--valid-every",
                "0", "--save-every", "150", "--quiet"])
    assert done.returncode == 0, done.stderr
    return out_dir


def _translate_one_by_one(run_dir: Path, sentences: list[str]) -> list[str]:
    """The oracle: each sentence alone through Transformer.translate, without the CLI's batching and sorting."""
    model, tokenizer = load_checkpoint_model(sorted(run_dir.glob("checkpoint_*.pt"))[-1])
    outputs = []
    for ids in tokenizer.encode(sentences):
        best = model.translate(torch.tensor([ids + [EOS_ID]]), beam_size=4, length_penalty=0.6)[0][0]
        outputs.append(tokenizer.decode([best.tokens])[0])
    return outputs


def test_translate_stdin_to_stdout_matches_sentence_by_sentence_search(trained: Path):
    done = run(["translate", "--device", "cpu", "--out-dir", str(trained)], stdin="".join(s + "\n" for s in SENTENCES))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == _translate_one_by_one(trained, SENTENCES)
    assert sum(line.strip() != "" for line in lines) == len(SENTENCES)


def test_translate_files_keeps_order_and_count(trained: Path, tmp_path: Path):
    sources = read_lines(BUNDLED_CORPUS / "test.en")[:12]
    (tmp_path / "in.en").write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    done = run(["translate", "--device", "cpu", "--out-dir", str(trained), "--input", str(tmp_path / "in.en"),
                "--output", str(tmp_path / "out.de"), "--batch-tokens", "64", "--beam", "2"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    translations = read_lines(tmp_path / "out.de")
    model, tokenizer = load_checkpoint_model(sorted(trained.glob("checkpoint_*.pt"))[-1])
    assert translations == evaluate.translate_sentences(model, tokenizer, sources, beam_size=2, batch_tokens=10_000)


def test_evaluate_prints_sacrebleu_with_signatures(trained: Path, tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    for lang in ("en", "de"):
        lines = (BUNDLED_CORPUS / f"test.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)[:40]
        (data / f"newstest2014.{lang}").write_text("".join(lines), encoding="utf-8")
    done = run(["evaluate", "--device", "cpu", "--out-dir", str(trained), "--data-dir", str(data), "--output",
                        str(tmp_path / "hyp.de")])
    assert done.returncode == 0, done.stderr
    hypotheses = read_lines(tmp_path / "hyp.de")
    references = read_lines(data / "newstest2014.de")
    for tokenize in ("13a", "intl"):
        line = next(line for line in done.stdout.splitlines() if f"tok:{tokenize}|" in line)
        expected = sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize).score
        signature = f"BLEU|nrefs:1|case:mixed|eff:no|tok:{tokenize}|smooth:exp|version:{sacrebleu.__version__}"
        assert line.startswith(signature + " = ")
        assert float(line.split(" = ")[1].split()[0]) == pytest.approx(expected, abs=0.005)
    assert expected > 0, "150 steps on the bundled corpus already translate something right"
    flags = ["evaluate", "--device", "cpu", "--out-dir", str(trained), "--data-dir", str(data)]
    done = run(flags + ["--output", str(data / "newstest2014.en")])
    assert done.returncode != 0 and "writing it would destroy it" in done.stderr and "Traceback" not in done.stderr
    assert read_lines(data / "newstest2014.en")[0] == (BUNDLED_CORPUS / "test.en").read_text().splitlines()[0]
    for lang in ("en", "de"):
        (data / f"newstest2014.{lang}").write_text("", encoding="utf-8")
    done = run(flags)
    assert done.returncode != 0 and "has no sentence pairs: nothing to evaluate" in done.stderr


def test_translate_and_evaluate_in_int8(trained: Path, tmp_path: Path):
    """--compute-type int8 translates as load_translator(compute_type="int8") does, and evaluate says which type ran
    and the size of its converted weights."""
    done = run(["translate", "--device", "cpu", "--out-dir", str(trained), "--compute-type", "int8"],
               stdin="".join(s + "\n" for s in SENTENCES))
    assert done.returncode == 0, done.stderr
    translator = load_translator(sorted(trained.glob("checkpoint_*.pt"))[-1], "cpu", compute_type="int8")
    assert done.stdout.splitlines() == translator.translate(SENTENCES, beam_size=4, length_penalty=0.6)
    data = tmp_path / "data"
    data.mkdir()
    for lang, lines in (("en", SENTENCES), ("de", SENTENCES)):
        (data / f"newstest2014.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    done = run(["evaluate", "--device", "cpu", "--out-dir", str(trained), "--data-dir", str(data),
                "--compute-type", "int8"])
    assert done.returncode == 0, done.stderr
    assert f"compute type int8, converted weights {translator.converted_nbytes / 2**20:.1f} MiB)" in done.stdout


def test_a_compute_type_the_device_lacks_is_one_line(trained: Path):
    done = run(["translate", "--device", "cpu", "--out-dir", str(trained), "--compute-type", "float16"],
               stdin="Hello.\n")
    assert done.returncode == 1
    assert done.stderr == ("fastformer translate: error: compute_type 'float16' runs on CUDA only; on the CPU use one "
                           "of float32, bfloat16, int8\n")
    done = run(["translate", "--out-dir", str(trained), "--compute-type", "int4"], stdin="Hello.\n")
    assert done.returncode == 2 and "--compute-type: invalid choice: 'int4'" in done.stderr
    assert all(name in done.stderr for name in ("auto", "float32", "float16", "bfloat16", "int8"))


def test_corrupt_or_foreign_checkpoint_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"PK\x03\x04 truncated zip")
    done = run(["translate", "--checkpoint", str(path)], stdin="Hello.\n")
    assert done.returncode != 0 and f"{path} is not a readable checkpoint" in done.stderr
    torch.save({"model": {}}, path)
    done = run(["evaluate", "--checkpoint", str(path)])
    assert done.returncode != 0 and f"{path} is not a fastformer checkpoint" in done.stderr
    done = run(["translate", "--checkpoint", str(tmp_path / "absent.pt")], stdin="Hello.\n")
    assert done.returncode != 0 and f"checkpoint not found: {tmp_path / 'absent.pt'}" in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_test_split_names_the_files(trained: Path, tmp_path: Path):
    done = run(["evaluate", "--out-dir", str(trained), "--data-dir", str(tmp_path)])
    assert done.returncode != 0 and "newstest2014.en" in done.stderr and "Traceback" not in done.stderr


def test_blank_lines_give_blank_lines_on_stdin_and_from_input(trained: Path, tmp_path: Path):
    """fairseq-interactive style: output stays line-aligned with input, an empty line in gives an empty line out."""
    lines = [SENTENCES[0], "", "   ", SENTENCES[1], "\t"]
    expected = _translate_one_by_one(trained, [SENTENCES[0], SENTENCES[1]])
    (tmp_path / "in.en").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    from_stdin = run(["translate", "--device", "cpu", "--out-dir", str(trained)],
                     stdin=(tmp_path / "in.en").read_text(encoding="utf-8"))
    from_file = run(["translate", "--device", "cpu", "--out-dir", str(trained), "--input", str(tmp_path / "in.en")])
    for done in (from_stdin, from_file):
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n") == [expected[0], "", "", expected[1], "", ""]


def test_a_line_over_the_model_limit_is_reported_by_line_and_size(trained: Path):
    long_line = " ".join(["the old man sees a small dog"] * 150)
    model, tokenizer = load_checkpoint_model(sorted(trained.glob("checkpoint_*.pt"))[-1])
    n_tokens = len(tokenizer.encode([long_line])[0])
    limit = model.config.max_positions - 1
    assert n_tokens > limit
    done = run(["translate", "--device", "cpu", "--out-dir", str(trained), "--beam", "1"],
               stdin=f"{SENTENCES[0]}\n{long_line}\n")
    assert done.returncode == 0, done.stderr
    assert (f"line 2 of stdin has {n_tokens} source tokens, more than the model's limit of {limit}: only its first "
            f"{limit} were translated") in done.stderr
    assert len(done.stdout.splitlines()) == 2


def test_non_utf8_stdin_is_one_line_naming_the_line(trained: Path):
    done = run(["translate", "--device", "cpu", "--out-dir", str(trained)],
               stdin="Hello.\n".encode() + "Gr\u00fc\u00dfe.\n".encode("latin-1"))
    assert done.returncode == 1
    assert done.stderr == "fastformer translate: error: stdin:2: not valid UTF-8 (invalid start byte at byte 2)\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable GPU")
def test_cuda_without_a_gpu_is_refused_before_any_work(trained: Path):
    done = run(["translate", "--device", "cuda", "--out-dir", str(trained)], stdin="Hello.\n")
    assert done.returncode == 1 and done.stderr.startswith("fastformer translate: error: --device cuda: ")
    assert done.stderr.count("\n") == 1


def test_average_of_fewer_checkpoints_than_asked_warns(trained: Path, tmp_path: Path):
    output = tmp_path / "average.pt"
    done = run(["average", "--out-dir", str(trained), "--last", "5", "--output", str(output)])
    assert done.returncode == 0, done.stderr
    assert f"--last 5 asks for 5 checkpoints, but {trained} has only 1: averaging 1" in done.stderr
    assert done.stdout.startswith("averaged 1 checkpoint (")
    assert checkpoint.load_checkpoint(output).averaged_from == [str(checkpoint.list_checkpoints(trained)[0])]


def test_average_never_writes_over_a_checkpoint_resume_reads(trained: Path, tmp_path: Path):
    newest = checkpoint.list_checkpoints(trained)[-1]
    before = newest.read_bytes()
    done = run(["average", "--inputs", str(newest), "--output", str(newest)])
    assert done.returncode == 1 and f"--output {newest} is --inputs {newest}, which this command reads" in done.stderr
    done = run(["average", "--out-dir", str(trained), "--output", str(tmp_path / "checkpoint_00000099.pt")])
    assert done.returncode == 1 and "is named as a training step's checkpoint" in done.stderr
    assert newest.read_bytes() == before and not (tmp_path / "checkpoint_00000099.pt").exists()


def test_average_of_an_empty_inputs_list_is_refused(trained: Path, tmp_path: Path):
    """A glob that matched nothing (nullglob, or $(ls ...)) must not fall back to --out-dir's checkpoints."""
    done = run(["average", "--out-dir", str(trained), "--inputs", "--output", str(tmp_path / "average.pt")])
    assert done.returncode == 2 and done.stderr.strip().endswith("argument --inputs: expected at least one argument")
    assert not (tmp_path / "average.pt").exists()


def test_a_wrong_model_path_is_named_for_what_it_is(trained: Path, tmp_path: Path):
    ct2 = tmp_path / "ct2"
    ct2.mkdir()
    (ct2 / "model.bin").write_bytes(b"\x06\x00")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    for given, message in ((trained, "is a training run's directory: give one of its checkpoint_*.pt files"),
                           (ct2, "is a CTranslate2 model directory"),
                           (tmp_path / "metrics.jsonl", "is not a fastformer checkpoint: torch.load cannot read it")):
        done = run(["translate", "--checkpoint", str(given)], stdin="Hello.\n")
        assert done.returncode == 1 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr
    done = run(["export", "--out-dir", str(trained), "--output", str(tmp_path / "metrics.jsonl")])
    assert done.returncode == 1 and "is a file: export writes a CTranslate2 model directory" in done.stderr


def test_help_names_the_script_and_every_option_has_help():
    parser = build_parser()
    assert "python -m fastformer" not in parser.format_help()
    assert parser.format_help().startswith("usage: fastformer ")
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        text = " ".join(command.format_help().split())
        for action in command._actions:
            assert action.help, f"fastformer {name} {action.option_strings} has no help"
            if action.default not in (None, False, argparse.SUPPRESS):
                assert f"(default: {action.default})" in text, f"fastformer {name} {action.option_strings}"


def test_model_and_tokenizer_special_ids_must_agree(trained: Path, tmp_path: Path):
    saved = checkpoint.load_checkpoint(sorted(trained.glob("checkpoint_*.pt"))[-1])
    saved.config = {**saved.config, "eos_id": 5}
    checkpoint.save_checkpoint(saved, tmp_path / "mismatched.pt")
    with pytest.raises(ValueError, match="special ids"):
        load_checkpoint_model(tmp_path / "mismatched.pt")
