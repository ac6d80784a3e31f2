"""fastformer.translation.export.to_ctranslate2: CTranslate2 running the exported model gives fastformer's
log-probabilities and its greedy and beam-search outputs, for post-LN and pre-LN, relu/gelu/swish, scaled or unscaled embeddings, tied or
separate output weights, an output bias and either position layout."""


import errno
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import Transformer, TransformerConfig, checkpoint
from fastformer.data.tokenizer import Tokenizer, train_tokenizer
from fastformer.reference.beam_search import beam_search
from fastformer.translation.export import to_ctranslate2, vocabulary
from test_scoring import teacher_forced_log_probs

ctranslate2 = pytest.importorskip("ctranslate2")

VOCAB = 40
PIECES = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, VOCAB)]
MAX_LEN = 16
# Source lengths (without EOS) of the translated batch.
SOURCE_LENGTHS = (5, 9, 3, 7, 2, 12, 6, 4)

CONFIGS = {
    "post-ln-relu": dict(),
    "pre-ln-gelu": dict(norm_first=True, activation="gelu"),
    "post-ln-swish-unscaled-bias": dict(activation="swish", scale_embedding=False, output_bias=True),
    "pre-ln-relu-untied-halves": dict(norm_first=True, tie_embeddings=False, position_layout="halves"),
    "post-ln-gelu-untied-bias": dict(activation="gelu", tie_embeddings=False, output_bias=True),
    "marian-like": dict(activation="swish", scale_embedding=False, output_bias=True, tie_embeddings=False,
                        position_layout="halves", bos_id=0),
}


def random_model(seed: int, **overrides) -> Transformer:
    """A tiny model with every parameter random (biases, LayerNorm gains and shifts too), so that no part of the
    export can be wrong unseen; PAD's output bias is very low so that it never competes in a search."""
    torch.manual_seed(seed)
    config = TransformerConfig.tiny(VOCAB, dropout=0.0, **overrides)
    model = Transformer(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
            elif parameter.dim() == 1:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
        if model.output_projection is not None:
            # Independent of the input embedding, so that a token does not predict itself over and over.
            model.output_projection.weight.normal_(0.0, 1.0, generator=generator)
        if model.output_bias is not None:
            model.output_bias[[config.pad_id, config.bos_id]] = -30.0
    return model


def model_ending_at_varied_lengths(seed: int, beam_size: int, search_options: dict | None = None,
                                   **overrides) -> Transformer:
    """A random_model (the first of a few seeds) with EOS's output row scaled (the first of a fixed list of scales)
    so that fastformer's reference search ends the batch's sentences at two or more different lengths before
    MAX_LEN. For a beam, all beam_size hypotheses of every sentence must end before MAX_LEN: the search then never
    meets the length limit, where fastformer forces EOS and CTranslate2 keeps the hypothesis without one."""
    search_options = search_options or {}
    for model_seed in range(seed, seed + 4):
        model = random_model(model_seed, **overrides)
        eos = model.config.eos_id
        row = model.output_weight[eos].detach().clone()
        for scale in (1.0, 1.25, 1.5, 1.75, 2.0, 0.8, 0.6, 2.5, 3.0):
            with torch.no_grad():
                model.output_weight[eos] = row * scale
            sentences = reference_search(model, beam_size, n_best=beam_size, **search_options)
            best_lengths = {len(hypotheses[0].tokens) for hypotheses in sentences} - {MAX_LEN}
            limit_met = any(len(h.tokens) == MAX_LEN for hypotheses in sentences for h in hypotheses)
            if len(best_lengths) >= 2 and (beam_size == 1 or not limit_met):
                return model
    raise AssertionError(f"no seed and EOS scale give varied output lengths for {overrides}")


def reference_search(model: Transformer, beam_size: int, **options) -> list[list]:
    """fastformer's search rules (the reference beam search, the oracle of model.translate) on source_batch ->
    each sentence's hypotheses, best first; min_len 0 for a beam (see beam_outputs)."""
    with fastformer.backend("reference"):
        return beam_search(model, source_batch(model.config), beam_size=beam_size, max_len_a=0, max_len_b=MAX_LEN,
                           min_len=1 if beam_size == 1 else 0, **options)


def source_batch(config: TransformerConfig) -> torch.Tensor:
    """[batch, src_len] right-padded random ids ending in EOS (ids 4.. are ordinary pieces)."""
    generator = torch.Generator().manual_seed(7)
    rows = [torch.cat([torch.randint(4, VOCAB, (n,), generator=generator), torch.tensor([config.eos_id])])
            for n in SOURCE_LENGTHS]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=config.pad_id)


def pieces(tokens: torch.Tensor | list[int], config: TransformerConfig) -> list[str]:
    """Ids of one sentence (padding and the final EOS dropped: CTranslate2 adds its own) -> token strings."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    ids = [i for i in ids if i != config.pad_id]
    return [PIECES[i] for i in (ids[:-1] if ids and ids[-1] == config.eos_id else ids)]


def vocabulary_for(config: TransformerConfig) -> list[str]:
    """PIECES with the specials moved to the config's ids (a Marian-like model starts the decoder from <pad>)."""
    tokens = list(PIECES)
    if config.bos_id == config.pad_id:
        tokens[1] = "w1"
    return tokens


def export(model: Transformer, tmp_path, quantization: str = "float32"):
    out_dir = to_ctranslate2(model, vocabulary_for(model.config), tmp_path / "ct2", quantization=quantization)
    return ctranslate2.Translator(str(out_dir), device="cpu", intra_threads=1)


@pytest.mark.parametrize("name", CONFIGS)
def test_ctranslate2_scores_equal_fastformers_teacher_forced_log_probs(name, tmp_path):
    model = random_model(11, **CONFIGS[name])
    config = model.config
    src = source_batch(config)
    generator = torch.Generator().manual_seed(3)
    targets = [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in (4, 1, 7, 0, 11, 3, 5, 9)]
    expected = teacher_forced_log_probs(model, src, targets)
    results = export(model, tmp_path).score_batch([pieces(s, config) for s in src],
                                                  [[PIECES[i] for i in t] for t in targets])
    for sentence, (result, want) in enumerate(zip(results, expected)):
        got = torch.tensor(result.log_probs, dtype=torch.float64)
        assert got.shape == want.shape, f"sentence {sentence}: {len(result.log_probs)} scores for {len(want)} tokens"
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"sentence {sentence}")
        assert abs(got.sum() - want.sum()) <= 1e-4 * max(1.0, abs(float(want.sum())))


# The configs model.translate's compiled decoder covers: the paper's (no output bias, scaled embeddings, relu/gelu).
COMPILED_DECODER_CONFIGS = ["post-ln-relu", "pre-ln-gelu", "pre-ln-relu-untied-halves"]


# Tied pre-LN random models repeat one token without end, whatever EOS's scale: left to the scoring test.
GREEDY_CONFIGS = [name for name in CONFIGS if name != "pre-ln-gelu"]


@pytest.mark.parametrize("name", GREEDY_CONFIGS)
def test_greedy_outputs_identical(name, tmp_path):
    """Beam 1: the argmax at each step, so CTranslate2 barring PAD and BOS before its softmax (fastformer bars them
    after) cannot change the outcome; both cut at MAX_LEN tokens."""
    model = model_ending_at_varied_lengths(13, beam_size=1, **CONFIGS[name])
    config = model.config
    src = source_batch(config)
    expected = [hypotheses[0].tokens for hypotheses in reference_search(model, beam_size=1)]
    if name in COMPILED_DECODER_CONFIGS:
        assert [h[0].tokens for h in model.translate(src, beam_size=1, max_len_a=0, max_len_b=MAX_LEN)] == expected
    barred = [[PIECES[config.pad_id]]] + ([[vocabulary_for(config)[config.bos_id]]]
                                          if config.bos_id != config.pad_id else [])
    results = export(model, tmp_path).translate_batch([pieces(s, config) for s in src], beam_size=1,
                                                      max_decoding_length=MAX_LEN, suppress_sequences=barred)
    got = [[vocabulary_for(config).index(p) for p in r.hypotheses[0]] for r in results]
    assert got == expected
    assert len({len(tokens) for tokens in expected}) >= 2


# With an output bias, PAD and BOS get ~no probability, so that barring them (fastformer, after its softmax) or not
# (CTranslate2) changes no ranking.
BEAM_CONFIGS = ["post-ln-swish-unscaled-bias", "marian-like"]


def beam_outputs(model: Transformer, tmp_path, **fastformer_options) -> tuple[list, list]:
    """Beam 4 with min_len 0 in both (each bars EOS on its own side of the softmax otherwise): -> (the best
    hypotheses under fastformer's rules, CTranslate2's best (tokens with EOS, score))."""
    config = model.config
    src = source_batch(config)
    expected = [hypotheses[0] for hypotheses in reference_search(model, beam_size=4, **fastformer_options)]
    alpha = fastformer_options["length_penalty"]
    results = export(model, tmp_path).translate_batch(
        [pieces(s, config) for s in src], beam_size=4, length_penalty=alpha, min_decoding_length=0,
        max_decoding_length=MAX_LEN + 1, return_scores=True, return_end_token=True)
    tokens = vocabulary_for(config)
    got = [([tokens.index(p) for p in r.hypotheses[0]], r.scores[0]) for r in results]
    return expected, got


# length_penalty 0: both rank finished hypotheses by their sum of log-probabilities, EOS included. Without a penalty
# CTranslate2 stops a sentence only when its top beam ends (fastformer: once beam_size hypotheses have), so where the
# top beam runs to the length limit the two differ: the marian-like model does, the first config does not.
# length_penalty 1 with CTranslate2's form: it divides a finished hypothesis' sum by its length (EOS counted,
# return_end_token) to the power alpha, fastformer's length_penalty_form="length".
BEAM_CASES = ([(BEAM_CONFIGS[0], dict(length_penalty=0.0))]
              + [(name, dict(length_penalty=1.0, length_penalty_form="length")) for name in BEAM_CONFIGS])


@pytest.mark.parametrize("name,options", BEAM_CASES)
def test_beam4_identical(name, options, tmp_path):
    model = model_ending_at_varied_lengths(17, beam_size=4, search_options=options, **CONFIGS[name])
    expected, got = beam_outputs(model, tmp_path, **options)
    eos = model.config.eos_id
    assert [tokens for tokens, _ in got] == [h.tokens + [eos] for h in expected]
    for (_, score), hypothesis in zip(got, expected):
        assert abs(score - hypothesis.score) <= 1e-4 * max(1.0, abs(hypothesis.score))


def test_int8_export_stays_close(tmp_path):
    """int8 weights (random, untrained ones quantize poorly) change the scores by some percent, not more."""
    model = random_model(19)
    config = model.config
    src = source_batch(config)
    targets = [[5, 6, 7]] * len(SOURCE_LENGTHS)
    want = torch.tensor([float(lp.sum()) for lp in teacher_forced_log_probs(model, src, targets)], dtype=torch.float64)
    results = export(model, tmp_path, quantization="int8").score_batch([pieces(s, config) for s in src],
                                                                      [[PIECES[i] for i in t] for t in targets])
    got = torch.tensor([sum(r.log_probs) for r in results], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0.15, atol=0.5)


def test_a_trained_tokenizers_pieces_map_one_to_one(tmp_path):
    tokenizer = train_tokenizer(["the old man has a small dog", "der alte Mann hat einen kleinen Hund"] * 20,
                                vocab_size=60)
    tokens = vocabulary(tokenizer)
    assert tokens[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    sentence = "the old man"
    ids = tokenizer.encode([sentence])[0]
    assert [tokenizer.processor.piece_to_id(tokens[i]) for i in ids] == ids
    model = random_model(23)
    with pytest.raises(ValueError, match="vocab_size"):
        to_ctranslate2(model, tokenizer, tmp_path / "ct2")
    model = Transformer(TransformerConfig.tiny(tokenizer.vocab_size)).eval()
    translator = ctranslate2.Translator(str(to_ctranslate2(model, Tokenizer(tokenizer.model_proto), tmp_path / "ct2")))
    assert len(translator.score_batch([[tokens[i] for i in ids]], [[tokens[ids[0]]]])[0].log_probs) == 2


def test_bad_input_is_named(tmp_path):
    model = random_model(29)
    with pytest.raises(ValueError, match="twice"):
        to_ctranslate2(model, PIECES[:-1] + ["w4"], tmp_path / "a")
    with pytest.raises(ValueError, match="quantization"):
        to_ctranslate2(model, PIECES, tmp_path / "b", quantization="int3")
    with pytest.raises(TypeError, match="fastformer.Transformer"):
        to_ctranslate2(torch.nn.Linear(2, 2), PIECES, tmp_path / "c")
    with pytest.raises(ValueError, match="<unk>"):
        to_ctranslate2(model, ["<pad>", "<s>", "</s>", "x3"] + PIECES[4:], tmp_path / "d")


def test_a_failed_export_leaves_the_model_there_as_it_was(tmp_path, monkeypatch):
    """A full disk midway through model.bin: the earlier export in the directory is untouched (a partial model.bin
    in its place would be a model CTranslate2 refuses), no staging directory is left, and the error names the
    directory and the space."""
    out_dir = tmp_path / "ct2"
    to_ctranslate2(random_model(30), PIECES, out_dir, quantization="int8")
    before = {path.name: path.read_bytes() for path in out_dir.iterdir()}
    real_save = ctranslate2.specs.TransformerSpec.save

    def save_then_fill_the_disk(spec, directory):
        real_save(spec, directory)
        with open(Path(directory) / "model.bin", "r+b") as model_file:
            model_file.truncate(1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ctranslate2.specs.TransformerSpec, "save", save_then_fill_the_disk)
    with pytest.raises(OSError, match=f"cannot write the CTranslate2 model {out_dir}: No space left on device after "
                                      rf"[\d,]+ bytes, with [\d,]+ free in {tmp_path}; {out_dir} is as it was"):
        to_ctranslate2(random_model(31), PIECES, out_dir, quantization="float32")
    assert {path.name: path.read_bytes() for path in out_dir.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ct2"]
    monkeypatch.setattr(ctranslate2.specs.TransformerSpec, "save", real_save)
    to_ctranslate2(random_model(31), PIECES, out_dir, quantization="float32")
    assert (out_dir / "model.bin").read_bytes() != before["model.bin"]
    assert oct(out_dir.stat().st_mode & 0o777) == oct(0o777 & ~checkpoint.current_umask())


def test_cli_exports_a_checkpoint_that_ctranslate2_scores_like_fastformer(tmp_path, capsys):
    """`fastformer export` writes the checkpoint's model and vocabulary: CTranslate2's score of a sentence pair given
    as the tokenizer's pieces is fastformer's teacher-forced log-probability of the same ids."""
    from fastformer import checkpoint
    from fastformer.__main__ import main
    from fastformer.data import BUNDLED_CORPUS, read_lines

    tokenizer = train_tokenizer(read_lines(BUNDLED_CORPUS / "valid.en")[:200]
                                + read_lines(BUNDLED_CORPUS / "valid.de")[:200], vocab_size=120)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(tokenizer.vocab_size, dropout=0.0)).eval()
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_checkpoint(checkpoint.Checkpoint(model=model.state_dict(), config=model.config.to_dict(),
                                                     tokenizer=tokenizer.model_proto), path)
    main(["export", "--checkpoint", str(path), "--output", str(tmp_path / "ct2")])
    assert "exported" in capsys.readouterr().out
    (source,), (target,) = tokenizer.encode(["the old man has a small dog"]), tokenizer.encode(["der alte Mann"])
    pieces = vocabulary(tokenizer)
    result = ctranslate2.Translator(str(tmp_path / "ct2")).score_batch([[pieces[i] for i in source]],
                                                                        [[pieces[i] for i in target]])[0]
    config = model.config
    src = torch.tensor([source + [config.eos_id]])
    tgt_in, tgt_out = torch.tensor([[config.bos_id] + target]), torch.tensor([target + [config.eos_id]])
    with fastformer.backend("reference"), torch.no_grad():
        log_probs = F.log_softmax(model(src, tgt_in), dim=-1)[0].gather(1, tgt_out[0, :, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.log_probs), log_probs, rtol=1e-4, atol=1e-4)
    # An earlier export is replaced; a directory of other files is written into only with --force.
    main(["export", "--checkpoint", str(path), "--output", str(tmp_path / "ct2")])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="holds files but no CTranslate2 model"):
        main(["export", "--checkpoint", str(path), "--output", str(tmp_path / "other")])
    assert (tmp_path / "other" / "config.json").read_text() == "{}"
    main(["export", "--checkpoint", str(path), "--output", str(tmp_path / "other"), "--force"])
    assert (tmp_path / "other" / "model.bin").is_file()


def test_cli_export_names_a_marian_directory_and_a_missing_checkpoint(tmp_path):
    from fastformer.__main__ import main

    with pytest.raises(SystemExit, match="is a directory"):
        main(["export", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "ct2")])
    with pytest.raises(SystemExit, match="missing.pt"):
        main(["export", "--checkpoint", str(tmp_path / "missing.pt"), "--output", str(tmp_path / "ct2")])


def test_cli_exports_a_checkpoint_fine_tuned_from_a_marian_model(tmp_path, capsys):
    """A checkpoint that keeps a Marian model's two sentencepiece models and joint vocabulary (as `--init-from` a
    Marian directory writes it) exports like any other: CTranslate2's score of a pair given as Marian's pieces is
    fastformer's teacher-forced log-probability of the same ids (output bias, swish, scaled embeddings, a decoder
    started from pad)."""
    from fastformer import checkpoint
    from fastformer.__main__ import main
    from fastformer.translation import marian
    from marian_models import write_marian

    directory = tmp_path / "opus-mt"
    write_marian(directory, activation="swish", output_bias=True, seed=1)
    model, source_tokenizer, target_tokenizer = marian.load_marian(directory)
    with torch.no_grad():
        model.output_bias.normal_()  # a bias that matters: transformers' tiny model starts it at zeros
    files = {name: (directory / name).read_bytes() for name in ("source.spm", "target.spm", "vocab.json")}
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_checkpoint(checkpoint.Checkpoint(model=model.state_dict(), config=model.config.to_dict(),
                                                     tokenizer=files), path)
    main(["export", "--checkpoint", str(path), "--output", str(tmp_path / "ct2")])
    assert "exported" in capsys.readouterr().out
    (source,), (target,) = source_tokenizer.encode(["the old man"]), target_tokenizer.encode(["der alte Mann"])
    config = model.config
    source = source[:-1] if source[-1] == config.eos_id else source  # CTranslate2 appends EOS itself
    pieces = vocabulary(source_tokenizer)
    result = ctranslate2.Translator(str(tmp_path / "ct2")).score_batch([[pieces[i] for i in source]],
                                                                        [[pieces[i] for i in target]])[0]
    expected = teacher_forced_log_probs(model, torch.tensor([source + [config.eos_id]]), [target])[0].float()
    torch.testing.assert_close(torch.tensor(result.log_probs), expected, rtol=1e-4, atol=1e-4)
