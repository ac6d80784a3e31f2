"""fastformer.load_translator / Translator: text in, text out, for Marian directories (against transformers'
greedy search and MarianTokenizer) and fastformer checkpoints; the CLI scoring a Marian directory."""

from pathlib import Path

import pytest
import sacrebleu
import torch

import fastformer
from fastformer import checkpoint
from fastformer.__main__ import main
from fastformer.data import BUNDLED_CORPUS, EOS_ID, Tokenizer, read_lines, train_tokenizer
from fastformer.decoding import compiled
from fastformer.translation import translator as translator_module
from fastformer_process import DEMO_TEST_SENTENCES
from marian_models import CALIBRATION, GREEDY_MAX_TOKENS, built, greedy  # noqa: F401 (fixtures)

# transformers' generate is ~50x slower with two threads on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")

# The compiled decoder on each Marian difference: swish, the output bias, unscaled embeddings.
COMPILED_CONFIGS = ["relu-scaled-nobias", "swish-scaled-bias", "relu-unscaled-nobias"]


@pytest.mark.parametrize("name", COMPILED_CONFIGS)
def test_translator_greedy_matches_transformers_generate_and_decode(built, name):
    """Text through Translator (the compiled decoder) is text through MarianTokenizer, greedy generate, and
    MarianTokenizer's target decoding."""
    directory, reference, tokenizer = built(name)
    translator = fastformer.load_translator(directory, device="cpu")
    expected_ids = greedy(reference, tokenizer, CALIBRATION, GREEDY_MAX_TOKENS)
    expected = [tokenizer.decode(ids, skip_special_tokens=True, use_source_tokenizer=False) for ids in expected_ids]
    found = translator.translate(CALIBRATION, beam_size=1, max_len_a=0.0, max_len_b=GREEDY_MAX_TOKENS, min_len=0)
    assert found == expected
    assert isinstance(translator.model, fastformer.Transformer)


@pytest.mark.parametrize("name", ["swish-scaled-bias", "relu-unscaled-nobias"])
def test_beam4_with_the_peers_length_penalty_matches_generate(built, name):
    """Beam 4, |Y|**1.0 length normalization (length_penalty_form="length"): where transformers' beam search
    (early_stopping=True: done once 4 have finished, fastformer's rule) ends its best hypothesis with EOS, the
    compiled search returns the same hypothesis with the same score. Hypotheses cut at the length limit are left
    out: transformers scores a forced EOS as log-probability 0, fastformer (as fairseq) with the model's own."""
    directory, reference, tokenizer = built(name)
    model = fastformer.load_translator(directory, device="cpu").model
    batch = tokenizer(CALIBRATION, padding=True, return_tensors="pt")
    pad, eos = model.config.pad_id, model.config.eos_id
    with torch.no_grad():
        output = reference.generate(**batch, num_beams=4, do_sample=False, early_stopping=True, length_penalty=1.0,
                                    max_new_tokens=GREEDY_MAX_TOKENS + 1, bad_words_ids=[[pad]],
                                    forced_eos_token_id=eos, eos_token_id=eos, pad_token_id=pad,
                                    decoder_start_token_id=pad, return_dict_in_generate=True, output_scores=True)
    expected = [row[:row.index(eos)] if eos in row else row for row in output.sequences[:, 1:].tolist()]
    found = model.translate(batch["input_ids"], beam_size=4, length_penalty=1.0, length_penalty_form="length",
                            max_len_a=0.0, max_len_b=GREEDY_MAX_TOKENS, min_len=0)
    ended = [i for i, tokens in enumerate(expected) if len(tokens) < GREEDY_MAX_TOKENS]
    assert len(ended) >= 4 and len({len(expected[i]) for i in ended}) >= 2  # EOS reached, at varied lengths
    assert [found[i][0].tokens for i in ended] == [expected[i] for i in ended]
    torch.testing.assert_close(torch.tensor([found[i][0].score for i in ended]),
                               output.sequences_scores[ended].float(), rtol=1e-4, atol=1e-4)


def test_translator_batches_keep_order_and_results(built):
    directory, _, _ = built("relu-scaled-nobias")
    translator = fastformer.load_translator(directory, device="cpu")
    sentences = CALIBRATION[::-1] + CALIBRATION[:3]
    one_batch = translator.translate(sentences, beam_size=2, batch_tokens=100_000)
    # 1-token budgets: every sentence alone
    assert translator.translate(sentences, beam_size=2, batch_tokens=1) == one_batch
    assert translator.translate(sentences, beam_size=2, batch_tokens=60) == one_batch
    one_by_one = [translator.translate([sentence], beam_size=2)[0] for sentence in sentences]
    assert one_batch == one_by_one
    with pytest.raises(ValueError, match="batch_tokens"):
        translator.translate(sentences, batch_tokens=0)


@pytest.fixture
def tiny_checkpoint(tmp_path) -> tuple[Path, fastformer.Transformer, Tokenizer]:
    """A random tiny model with a small tokenizer, saved as `fastformer train` saves -> (path, model, tokenizer)."""
    sentences = read_lines(BUNDLED_CORPUS / "valid.en")[:200] + read_lines(BUNDLED_CORPUS / "valid.de")[:200]
    tokenizer = train_tokenizer(sentences, vocab_size=120)
    torch.manual_seed(0)
    model = fastformer.Transformer(fastformer.TransformerConfig.tiny(tokenizer.vocab_size, dropout=0.0)).eval()
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_checkpoint(checkpoint.Checkpoint(model=model.state_dict(), config=model.config.to_dict(),
                                                     tokenizer=tokenizer.model_proto), path)
    return path, model, tokenizer


def _one_by_one(model: fastformer.Transformer, tokenizer: Tokenizer, sources: list[str], **options) -> list[str]:
    """The oracle: each sentence alone through Transformer.translate, without Translator's batching and sorting."""
    expected = []
    for ids in tokenizer.encode(sources):
        best = model.translate(torch.tensor([ids + [EOS_ID]]), **options)[0][0]
        expected.append(tokenizer.decode([best.tokens])[0])
    return expected


def test_load_translator_reads_a_fastformer_checkpoint(tiny_checkpoint):
    path, model, tokenizer = tiny_checkpoint
    translator = fastformer.load_translator(path, device="cpu")
    assert translator.source_tokenizer.model_proto == tokenizer.model_proto
    assert translator.compute_type == "float32"
    sources = CALIBRATION[:5]
    assert translator.translate(sources, beam_size=3) == _one_by_one(model, tokenizer, sources, beam_size=3)


@pytest.mark.parametrize("compute_type", ["int8", "bfloat16"])
@pytest.mark.filterwarnings("ignore:compute_type='bfloat16' on a CPU without")
def test_translator_converts_once_at_load_and_translates_in_its_compute_type(tiny_checkpoint, compute_type):
    path, model, tokenizer = tiny_checkpoint
    translator = fastformer.load_translator(path, device="cpu", compute_type=compute_type)
    assert translator.compute_type == compute_type
    loaded = translator.model
    converted = loaded._compiled_cache.get(loaded, compute_type)
    assert converted is not None and converted.nbytes == translator.converted_nbytes
    sources = CALIBRATION[:5]
    found = translator.translate(sources, beam_size=3)
    assert loaded._compiled_cache.get(loaded, compute_type) is converted  # not converted again
    assert found == _one_by_one(model, tokenizer, sources, beam_size=3, compute_type=compute_type)
    float32 = fastformer.load_translator(path, device="cpu").converted_nbytes
    # int8: + each row's float32 bias, scale and zero point, a larger share of the tiny model's small layers;
    # bfloat16 at least half of float32, but where float32 runs fastformer's own GEMM (the CPU loops are AVX-512's or
    # AVX2's), whose panels of 16 outputs add padding: 0.4985
    own_float32_gemm = compiled.extension().cpu_isa() in ("avx512", "avx2")
    low, high = (0.25, 0.33) if compute_type == "int8" else (0.49 if own_float32_gemm else 0.5, 0.55)
    assert low * float32 <= translator.converted_nbytes < high * float32


def test_translator_compute_type_auto_and_bad_values(tiny_checkpoint):
    path, _, _ = tiny_checkpoint
    expected = "int8" if compiled.has_int8_linear() else "float32"
    assert fastformer.load_translator(path, device="cpu", compute_type="auto").compute_type == expected
    with pytest.raises(ValueError, match="compute_type must be one of auto, float32, float16, bfloat16, int8"):
        fastformer.load_translator(path, device="cpu", compute_type="int4")
    with pytest.raises(ValueError, match="'float16' runs on CUDA only; on the CPU use one of float32, bfloat16, int8"):
        fastformer.load_translator(path, device="cpu", compute_type="float16")


def test_load_translator_names_a_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        fastformer.load_translator(tmp_path / "absent.pt")


def test_cli_evaluates_a_marian_directory_with_sacrebleu(built, tmp_path, capsys):
    directory, _, _ = built("relu-scaled-nobias")
    data = tmp_path / "data"
    data.mkdir()
    sources, references = CALIBRATION[:6], read_lines(BUNDLED_CORPUS / "valid.de")[:6]
    (data / "test.en").write_text("".join(line + "\n" for line in sources), encoding="utf-8")
    (data / "test.de").write_text("".join(line + "\n" for line in references), encoding="utf-8")
    output = tmp_path / "hypotheses.de"
    main(["evaluate", "--checkpoint", str(directory), "--data-dir", str(data), "--beam", "2", "--device", "cpu",
          "--output", str(output)])
    printed = capsys.readouterr().out
    hypotheses = fastformer.load_translator(directory, device="cpu").translate(sources, beam_size=2)
    assert read_lines(output) == hypotheses
    metric = sacrebleu.metrics.BLEU(tokenize="13a")
    line = metric.corpus_score(hypotheses, [references]).format(signature=str(metric.get_signature()))
    assert line in printed.splitlines()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:compute_type='bfloat16' on a CPU without")
def test_int8_and_bfloat16_translate_a_trained_model_as_float32_does(demo_run):
    """On the demo's trained model, the whole bundled test split (beam 4): bfloat16 and int8 score within 0.5 BLEU of
    float32, at least 90% of the lines identical; and float32 on its first DEMO_TEST_SENTENCES scores what the demo
    printed."""
    out_dir, done = demo_run
    sources, references = read_lines(BUNDLED_CORPUS / "test.en"), read_lines(BUNDLED_CORPUS / "test.de")
    path = checkpoint.newest_checkpoint(out_dir)
    translations = {compute_type: fastformer.load_translator(path, "cpu", compute_type).translate(sources)
                    for compute_type in ("float32", "int8", "bfloat16")}
    bleu = {compute_type: sacrebleu.corpus_bleu(lines, [references]).score
            for compute_type, lines in translations.items()}
    for compute_type in ("int8", "bfloat16"):
        identical = sum(a == b for a, b in zip(translations[compute_type], translations["float32"])) / len(sources)
        assert abs(bleu[compute_type] - bleu["float32"]) <= 0.5, (compute_type, bleu)
        assert identical >= 0.9, (compute_type, identical)
    if " on cpu in " in done.stdout:  # a GPU machine's demo decodes on the GPU, in another order of operations
        printed = next(line for line in done.stdout.splitlines() if "|tok:13a|" in line)
        first = sacrebleu.corpus_bleu(translations["float32"][:DEMO_TEST_SENTENCES],
                                      [references[:DEMO_TEST_SENTENCES]]).score
        assert first == pytest.approx(float(printed.split(" = ")[1].split()[0]), abs=0.006)


def test_n_best_results_of_a_marian_directory_name_its_target_pieces(built):
    """TranslationResult.tokens are the target side's vocab.json pieces, as MarianTokenizer names the ids."""
    directory, _, tokenizer = built("relu-scaled-nobias")
    translator = fastformer.load_translator(directory, device="cpu")
    results = translator.translate(CALIBRATION[:4], beam_size=3, n_best=2, max_len_b=8)
    src = tokenizer(CALIBRATION[:4], padding=True, return_tensors="pt")["input_ids"]
    expected = translator.model.translate(src, beam_size=3, n_best=2, max_len_b=8)
    for found, hypotheses in zip(results, expected):
        assert [result.tokens for result in found] == [tokenizer.convert_ids_to_tokens(h.tokens) for h in hypotheses]
        assert [result.text for result in found] == tokenizer.batch_decode([h.tokens for h in hypotheses],
                                                                           skip_special_tokens=True)


@pytest.mark.parametrize("marian", [False, True])
def test_a_line_over_long_text_chars_is_tokenized_in_pieces_as_it_would_be_whole(tiny_checkpoint, built, marian,
                                                                                 monkeypatch):
    """A line longer than LONG_TEXT_CHARS is tokenized a piece at a time (whole, a 50 MB line took 2.45 GB): its
    first ids and its count equal the whole line's, for the warning that names the count and for the translation
    and score of what the model reads. Pieces of 1,000 characters here, so that the test's lines stay small."""
    monkeypatch.setattr(translator_module, "LONG_TEXT_CHARS", 1000)
    path = built("relu-scaled-nobias")[0] if marian else tiny_checkpoint[0]
    translator = fastformer.load_translator(path, device="cpu")
    limit = translator.model.config.max_positions - 1
    words = read_lines(BUNDLED_CORPUS / "valid.en")[:400]
    long_line = "  ".join(words)  # double spaces, whose runs the tokenizer collapses, on the pieces' cuts too
    short = words[0]
    whole = translator.source_tokenizer.encode([short, long_line, "x" * 2500])
    encoded, counts = translator_module._encode(translator.source_tokenizer, [short, long_line, "x" * 2500], 1,
                                                "source", keep=limit)
    # A text without spaces is cut anywhere: each later piece may count a word-start piece more (2 cuts here).
    assert counts[1] == len(whole[1]) > 3 * limit and 0 <= counts[2] - len(whole[2]) <= 2 and len(counts) == 2
    assert encoded == [whole[0], whole[1][:limit + 1], whole[2][:limit + 1]]
    reported = []
    got = translator.translate([short, long_line], beam_size=2,
                               on_truncated=lambda index, n_tokens, limit: reported.append((index, n_tokens)))
    assert reported == [(1, len(whole[1]))]
    monkeypatch.setattr(translator_module, "LONG_TEXT_CHARS", 1 << 16)
    assert got == translator.translate([short, long_line], beam_size=2, on_truncated=lambda *args: None)
