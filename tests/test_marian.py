"""Marian directories read into fastformer against transformers' MarianMTModel and MarianTokenizer (the oracle),
on tiny models built here with random weights; and every malformed directory rejected by name."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import fastformer
from fastformer.data import BUNDLED_CORPUS, read_lines
from fastformer.data.tokenizer import MARIAN_FILES, Tokenizers
from fastformer.reference.beam_search import beam_search
from fastformer.model import sinusoidal_positions
from fastformer.translation import marian
from marian_models import CALIBRATION, GREEDY_MAX_TOKENS, built, greedy  # noqa: F401 (fixtures)

# transformers' generate is ~50x slower with two threads on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")
from tolerances import FP32

# Each Marian difference from fastformer's defaults, alone or together.
TESTED_CONFIGS = ["swish-scaled-bias", "relu-unscaled-nobias", "swish-unscaled-bias", "relu-bin", "gelu-untied"]
TARGETS = read_lines(BUNDLED_CORPUS / "valid.de")[:len(CALIBRATION)]


def teacher_forced_batch(tokenizer, pad_id: int):
    """-> src, tgt_in = [pad, y...], tgt_out = [y..., eos] (right-padded with pad), tgt lengths."""
    src = tokenizer(CALIBRATION, padding=True, return_tensors="pt")["input_ids"]
    targets = tokenizer(text_target=TARGETS)["input_ids"]  # each ends with EOS
    longest = max(len(ids) for ids in targets)
    tgt_in = torch.full((len(targets), longest), pad_id)
    tgt_out = torch.full((len(targets), longest), pad_id)
    for row, ids in enumerate(targets):
        tgt_in[row, :len(ids)] = torch.tensor([pad_id] + ids[:-1])
        tgt_out[row, :len(ids)] = torch.tensor(ids)
    return src, tgt_in, tgt_out, [len(ids) for ids in targets]


@pytest.mark.parametrize("name", TESTED_CONFIGS)
def test_teacher_forced_logits_and_loss_match_transformers(built, name):
    directory, reference, tokenizer = built(name)
    model, _, _ = marian.load_marian(directory)
    pad = model.config.pad_id
    assert model.config.bos_id == pad and model.config.eos_id == 0
    src, tgt_in, tgt_out, lengths = teacher_forced_batch(tokenizer, pad)
    with torch.no_grad():
        expected = reference(input_ids=src, attention_mask=(src != pad).long(), decoder_input_ids=tgt_in).logits
        with fastformer.backend("reference"):
            logits = model(src, tgt_in)
            loss = model.loss(src, tgt_in, tgt_out)
    for row, length in enumerate(lengths):  # past a target's length fastformer's rows are padding
        torch.testing.assert_close(logits[row, :length], expected[row, :length], **FP32)
    expected_loss = F.cross_entropy(expected.transpose(1, 2), tgt_out, ignore_index=pad)
    torch.testing.assert_close(loss, expected_loss, **FP32)


@pytest.mark.parametrize("name", TESTED_CONFIGS)
def test_greedy_reference_search_matches_generate(built, name):
    """fastformer's full-recompute beam search at beam 1 (min_len 0, EOS forced after GREEDY_MAX_TOKENS tokens)
    is transformers' greedy search as OPUS-MT configures it."""
    directory, reference, tokenizer = built(name)
    model, _, _ = marian.load_marian(directory)
    expected = greedy(reference, tokenizer, CALIBRATION, GREEDY_MAX_TOKENS)
    assert len({len(tokens) for tokens in expected}) >= 3  # the weights are not degenerate: EOS is reached
    src = tokenizer(CALIBRATION, padding=True, return_tensors="pt")["input_ids"]
    found = beam_search(model, src, beam_size=1, max_len_a=0.0, max_len_b=GREEDY_MAX_TOKENS, min_len=0)
    assert [hypotheses[0].tokens for hypotheses in found] == expected


SOURCE_SENTENCES = CALIBRATION + [
    "", "  Two  spaces,  and a tab\there.", "Unknown symbols: \u20ac \u65e5\u672c \u00df!",
    ">>de<< The house is small.", ">>xx<< a code not in the vocabulary", "ALL CAPS 123 4.5",
]


def test_source_encoding_matches_marian_tokenizer(built):
    directory, _, tokenizer = built("swish-scaled-bias")
    _, source, _ = marian.load_marian(directory)
    expected = tokenizer(SOURCE_SENTENCES)["input_ids"]  # each ends with EOS (0)
    assert [ids + [0] for ids in source.encode(SOURCE_SENTENCES)] == expected
    assert any(tokenizer.unk_token_id in ids for ids in expected)  # the unknown-piece path is covered


def test_target_decoding_matches_marian_tokenizer(built):
    directory, _, tokenizer = built("swish-scaled-bias")
    _, _, target = marian.load_marian(directory)
    generator = torch.Generator().manual_seed(0)
    # Every id, the special ones included, in random sequences; and real German sentences' ids.
    sequences = [torch.randint(0, target.vocab_size, (n,), generator=generator).tolist() for n in range(0, 40)]
    sequences += tokenizer(text_target=TARGETS)["input_ids"]
    expected = [tokenizer.decode(ids, skip_special_tokens=True, use_source_tokenizer=False) for ids in sequences]
    assert target.decode(sequences) == expected
    assert target.decode(tokenizer(text_target=TARGETS)["input_ids"]) == TARGETS  # round trip of plain text


# ---- malformed directories ------------------------------------------------------------------------------------

def edit_config(**changes):
    def edit(directory: Path) -> None:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))
    return edit


def edit_weights(edit_state):
    def edit(directory: Path) -> None:
        state = load_file(directory / "model.safetensors")
        edit_state(state)
        save_file(state, directory / "model.safetensors")
    return edit


def remove(name: str):
    return lambda directory: (directory / name).unlink()


def rename_weight(old: str, new: str):
    return edit_weights(lambda state: state.__setitem__(new, state.pop(old)))


MALFORMED = {
    "no config": (remove("config.json"), FileNotFoundError, "config.json is missing"),
    "no vocab": (remove("vocab.json"), FileNotFoundError, "vocab.json is missing"),
    "no source spm": (remove("source.spm"), FileNotFoundError, "source.spm is missing"),
    "no target spm": (remove("target.spm"), FileNotFoundError, "target.spm is missing"),
    "no weights": (remove("model.safetensors"), FileNotFoundError, "model.safetensors nor pytorch_model.bin"),
    "not json": (lambda d: (d / "config.json").write_text("{"), ValueError, "config.json is not valid JSON"),
    "no d_model": (lambda d: _drop_config_key(d, "d_model"), ValueError, "no 'd_model'"),
    "other model": (edit_config(model_type="bart"), ValueError, "model_type 'bart'"),
    "activation": (edit_config(activation_function="gelu_new"), ValueError, "activation_function 'gelu_new'"),
    "pre-LN": (edit_config(normalize_before=True), ValueError, "normalize_before=true"),
    "embedding LN": (edit_config(normalize_embedding=True), ValueError, "normalize_embedding=true"),
    "learned positions": (edit_config(static_position_embeddings=False), ValueError,
                          "static_position_embeddings=false"),
    "separate decoder vocab": (edit_config(decoder_vocab_size=7), ValueError, "separate decoder vocabulary"),
    "unshared embeddings": (edit_config(share_encoder_decoder_embeddings=False), ValueError,
                            "share_encoder_decoder_embeddings=false"),
    "heads differ": (edit_config(decoder_attention_heads=4), ValueError, "encoder_attention_heads=2 != decoder"),
    "ffn differs": (edit_config(decoder_ffn_dim=32), ValueError, "encoder_ffn_dim=64 != decoder_ffn_dim=32"),
    "d_model not divisible": (edit_config(d_model=33), ValueError, "d_model=33 not divisible"),
    "bad words": (edit_config(bad_words_ids=[[5]]), ValueError, "bad_words_ids"),
    "eos equals pad": (lambda d: edit_config(eos_token_id=_config(d)["pad_token_id"])(d), ValueError,
                       "eos_id must differ"),
    "target vocab": (lambda d: shutil.copy(d / "vocab.json", d / "target_vocab.json"), ValueError,
                     "target_vocab.json"),
    "vocab eos": (lambda d: _swap_vocab_ids(d, 0, 5), ValueError, "gives '</s>' id 5"),
    "not spm": (lambda d: (d / "target.spm").write_bytes(b"junk"), ValueError, "target.spm is not a sentencepiece"),
    "corrupt weights": (lambda d: (d / "model.safetensors").write_bytes(b"junk"), ValueError,
                        "model.safetensors is not a readable weights file"),
    "missing weight": (edit_weights(lambda s: s.pop("model.decoder.layers.1.fc2.bias")), ValueError,
                       "no weight 'model.decoder.layers.1.fc2.bias'"),
    "embedding LN weight": (edit_weights(lambda s: s.__setitem__("model.encoder.layernorm_embedding.weight",
                                                                 torch.ones(32))),
                            ValueError, "no place for .*layernorm_embedding"),
    "learned position weights": (edit_weights(lambda s: s.__setitem__("model.encoder.embed_positions.weight",
                                                                      torch.randn(128, 32))),
                                 ValueError, "embed_positions.weight is not the \\[sin \\| cos\\] sinusoidal"),
    "position table of another shape": (edit_weights(lambda s: s.__setitem__(
        "model.encoder.embed_positions.weight", sinusoidal_positions(64, 32, "halves"))), ValueError,
        "does not match its config.json: model.encoder.embed_positions.weight is \\(64, 32\\), max_position_"
        "embeddings and d_model make \\(128, 32\\)"),
    "separate decoder embedding": (edit_weights(lambda s: s.__setitem__("model.decoder.embed_tokens.weight",
                                                                        torch.randn_like(s["lm_head.weight"])
                                                                        if "lm_head.weight" in s else
                                                                        torch.randn_like(s["model.shared.weight"]))),
                                   ValueError, "separate encoder and decoder embeddings"),
    "misshapen weight": (edit_weights(lambda s: s.__setitem__("model.encoder.layers.0.fc1.bias", torch.ones(3))),
                         ValueError, "does not match .*config.json"),
    "NaN weight": (edit_weights(lambda s: s["model.encoder.layers.0.fc1.bias"].__setitem__(1, float("nan"))),
                   ValueError, "not finite \\(NaN or inf\\) in encoder.layers.0.ffn.linear1.bias"),
    "activation a list": (edit_config(activation_function=["relu"]), ValueError,
                          'activation_function is \\["relu"\\], not a string'),
    "vocab_size a string": (edit_config(vocab_size="94"), ValueError, 'vocab_size is "94", not an integer'),
    "scale_embedding a string": (edit_config(scale_embedding="false"), ValueError,
                                 'scale_embedding is "false", not true or false'),
    "d_model a bool": (edit_config(d_model=True), ValueError, "d_model is true, not an integer"),
}


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def _drop_config_key(directory: Path, key: str) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    del config[key]
    path.write_text(json.dumps(config))


def _swap_vocab_ids(directory: Path, first: int, second: int) -> None:
    path = directory / "vocab.json"
    vocab = json.loads(path.read_text(encoding="utf-8"))
    swapped = {first: second, second: first}
    vocab = {piece: swapped.get(index, index) for piece, index in vocab.items()}
    path.write_text(json.dumps(vocab), encoding="utf-8")


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_directory_is_rejected_by_name(built, tmp_path, case):
    source, _, _ = built("swish-scaled-bias")
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    marian.load_marian(directory)  # the copy itself is fine
    corrupt, error, message = MALFORMED[case]
    corrupt(directory)
    with pytest.raises(error, match=message) as raised:
        marian.load_marian(directory)
    assert "\n" not in str(raised.value)


def test_a_position_table_saved_in_bfloat16_loads(built, tmp_path):
    """transformers' older pytorch_model.bin layout holds the sinusoidal tables; saved in bfloat16 they are off by up
    to 2^-9, and are still the sinusoidal table."""
    source, _, _ = built("swish-scaled-bias")
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    table = sinusoidal_positions(128, 32, "halves").to(torch.bfloat16)
    assert (table.float() - sinusoidal_positions(128, 32, "halves")).abs().max() > 1e-3
    edit_weights(lambda state: state.__setitem__("model.encoder.embed_positions.weight", table))(directory)
    model, _, _ = marian.load_marian(directory)
    reference, _, _ = marian.load_marian(source)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_not_a_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="Marian model directory not found"):
        marian.load_marian(tmp_path / "absent")


def test_a_special_token_cannot_tag_a_corpus(built):
    """--tag-extra with --init-from a Marian model: pad (which a Marian decoder starts from), eos and unk are read
    as what they are, so none of them can mark a tagged source."""
    directory, _, _ = built("swish-scaled-bias")
    tokenizers = Tokenizers.from_files({name: (directory / name).read_bytes() for name in MARIAN_FILES},
                                       str(directory))
    for special in ("<pad>", "</s>", "<unk>"):
        with pytest.raises(ValueError, match=f"{special!r} is a special token of the Marian model"):
            tokenizers.reserved_id(special, "the Marian model")
