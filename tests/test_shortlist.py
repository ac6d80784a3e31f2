"""Vocabulary shortlists: building one (against counts by brute force), translating with one (against the reference
search with the other logits masked, and against no shortlist when it holds the whole vocabulary), and bad input."""

import copy
import itertools

import pytest
import torch
from safetensors.torch import save_file

import fastformer
from fastformer import Shortlist, build_shortlist
from fastformer.__main__ import main
from fastformer.data import BUNDLED_CORPUS, read_lines
from fastformer.decoding.compiled import extension
from fastformer.decoding.shortlist import FORMAT
from fastformer.reference.beam_search import beam_search
from test_beam_search import assert_same_hypotheses, make_model, padded_sources, real_token_ids
from test_search_options import LENGTHS, PREFIXES
from test_translator import tiny_checkpoint  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def random_corpus(vocab: int, n_pairs: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Sentence pairs of ids in [3, vocab): each target id t is mostly the translation (t * 7) % vocab of a source
    id, so that the co-occurrence counts are far from uniform."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n_pairs):
        source = torch.randint(3, vocab, (int(torch.randint(1, 8, (1,), generator=generator)),), generator=generator)
        target = [max(3, (int(s) * 7) % vocab) for s in source] + [int(torch.randint(3, vocab, (1,),
                                                                                          generator=generator))]
        pairs.append((source.tolist(), target))
    return pairs


def brute_force_shortlist(pairs, vocab: int, per_source: int, always: int, eos_id: int,
                          excluded: set[int]) -> tuple[dict[int, list[int]], list[int]]:
    """The module docstring's rule, by counting in Python: -> ({source id: its candidates}, always-kept ids)."""
    source_counts, target_counts, pair_counts = {}, {}, {}
    for source, target in pairs:
        sources, targets = set(source), set(target) - excluded
        for s in sources:
            source_counts[s] = source_counts.get(s, 0) + 1
        for t in targets:
            target_counts[t] = target_counts.get(t, 0) + 1
        for s, t in itertools.product(sources, targets):
            pair_counts[s, t] = pair_counts.get((s, t), 0) + 1
    candidates = {}
    for s in source_counts:
        scored = [(-2.0 * c / (source_counts[s] + target_counts[t]), -c, t) for (s2, t), c in pair_counts.items()
                  if s2 == s]
        candidates[s] = [t for *_, t in sorted(scored)[:per_source]]
    frequent = [t for _, t in sorted((-c, t) for t, c in target_counts.items())[:always]]
    return candidates, sorted(set(frequent) | {eos_id})


@pytest.mark.parametrize("per_source,always", [(1, 0), (3, 2), (50, 100)])
def test_build_shortlist_equals_counting_by_hand(per_source, always):
    pairs = random_corpus(30, 200)
    shortlist = build_shortlist(pairs, 30, 30, eos_id=2, excluded_ids=(0, 1), per_source=per_source, always=always)
    candidates, kept = brute_force_shortlist(pairs, 30, per_source, always, 2, {0, 1})
    assert shortlist.always.tolist() == kept
    for s in range(30):
        row = [t for t in shortlist.candidates[s].tolist() if t >= 0]
        assert row == candidates.get(s, []), f"source id {s}"


def test_build_shortlist_merges_counts_across_chunks(monkeypatch):
    pairs = random_corpus(30, 200, seed=1)
    whole = build_shortlist(pairs, 30, 30, eos_id=2, excluded_ids=(0, 1), per_source=4, always=3)
    monkeypatch.setattr("fastformer.decoding.shortlist.CHUNK_PAIRS", 7)
    chunked = build_shortlist(pairs, 30, 30, eos_id=2, excluded_ids=(0, 1), per_source=4, always=3)
    assert torch.equal(whole.candidates, chunked.candidates) and torch.equal(whole.always, chunked.always)


def whole_vocabulary(vocab: int) -> Shortlist:
    return Shortlist(torch.full((vocab, 1), -1, dtype=torch.int64), torch.arange(vocab))


@pytest.mark.parametrize("compute_type", ["float32", "int8"])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_shortlist_of_the_whole_vocabulary_changes_nothing(beam_size, compute_type):
    model = make_model(eos_scale=1.5)
    src = padded_sources(model, LENGTHS)
    search = dict(beam_size=beam_size, n_best=beam_size, max_len_b=6, compute_type=compute_type)
    assert_same_hypotheses(model.translate(src, shortlist=whole_vocabulary(model.config.vocab_size), **search),
                           model.translate(src, **search))


def small_shortlist(model) -> Shortlist:
    """Two candidates per source id among 10 of the vocabulary's ids, and EOS."""
    vocab = model.config.vocab_size
    real = torch.tensor(real_token_ids(model.config))
    candidates = torch.stack([real[(torch.arange(vocab) * 5) % 6], real[6 + torch.arange(vocab) % 4]], 1)
    return Shortlist(candidates, torch.tensor([model.config.eos_id]))


def masked_model(model, ids: torch.Tensor):
    """A copy of model whose logits outside ids are -inf (its output bias), the oracle's view of a shortlist."""
    masked = copy.deepcopy(model)
    with torch.no_grad():
        outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
        outside[ids] = False
        masked.output_bias[outside] = float("-inf")
    return masked


@pytest.mark.parametrize("options", [{}, {"target_prefix": PREFIXES}, {"no_repeat_ngram_size": 2}])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_translate_with_a_shortlist_equals_the_reference_with_the_other_logits_masked(beam_size, options):
    model = make_model(eos_scale=1.5, output_bias=True)
    src = padded_sources(model, LENGTHS)
    shortlist = small_shortlist(model)
    prefix_ids = {t for prefix in options.get("target_prefix") or [] if prefix for t in prefix}
    ids = shortlist.vocabulary(src, model.lengths(src, "src_tokens"), prefix_ids)
    assert 3 <= len(ids) <= model.config.vocab_size // 2
    search = dict(beam_size=beam_size, n_best=beam_size, max_len_b=6, **options)
    got = model.translate(src, shortlist=shortlist, **search)
    assert_same_hypotheses(got, beam_search(masked_model(model, ids), src, **search))
    assert all(set(h.tokens) <= set(ids.tolist()) for sentence in got for h in sentence)


@pytest.mark.parametrize("compute_type", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("sampling", [{}, {"sampling_topk": 5, "seed": 2}])
def test_greedy_search_and_sampling_take_a_shortlist_without_scores(compute_type, sampling):
    """The tokens outside a shortlist have logits of -inf: the greedy path without scores takes them as barred, not
    as a row that is not finite."""
    model = make_model(eos_scale=1.5, output_bias=True)
    src = padded_sources(model, LENGTHS)
    search = dict(beam_size=1, max_len_b=6, shortlist=small_shortlist(model), compute_type=compute_type, **sampling)
    with_scores = model.translate(src, return_scores=True, **search)
    without = model.translate(src, return_scores=False, **search)
    assert [[h.tokens for h in sentence] for sentence in without] == \
        [[h.tokens for h in sentence] for sentence in with_scores]


def test_the_groups_of_a_two_thread_search_share_the_shortlist():
    model = make_model(eos_scale=1.5, output_bias=True)
    src = padded_sources(model, LENGTHS * 6)
    assert extension().cpu_sentence_groups(len(src), 4 * len(src), "float32", 2) == 2
    shortlist = small_shortlist(model)
    ids = shortlist.vocabulary(src, model.lengths(src, "src_tokens"))
    torch.set_num_threads(2)  # the module's one_thread fixture restores it
    assert_same_hypotheses(model.translate(src, shortlist=shortlist, max_len_b=6),
                           beam_search(masked_model(model, ids), src, max_len_b=6))


def test_shortlist_saves_and_loads(tmp_path):
    shortlist = build_shortlist(random_corpus(30, 50), 30, 30, eos_id=2, excluded_ids=(0, 1), per_source=3, always=2)
    shortlist.save(tmp_path / "shortlist.safetensors")
    loaded = Shortlist.load(tmp_path / "shortlist.safetensors", target_vocab_size=30)
    assert torch.equal(loaded.candidates, shortlist.candidates) and torch.equal(loaded.always, shortlist.always)


def test_bad_shortlists_are_named(tmp_path):
    model = make_model()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Shortlist.load(tmp_path / "missing")
    (tmp_path / "corrupt").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        Shortlist.load(tmp_path / "corrupt")
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "other"))
    with pytest.raises(ValueError, match="is not a fastformer shortlist"):
        Shortlist.load(tmp_path / "other")
    save_file({"candidates": torch.tensor([5, 6]), "always": torch.tensor([2])}, str(tmp_path / "flat"),
              metadata={"format": FORMAT})
    with pytest.raises(ValueError, match="is corrupt"):
        Shortlist.load(tmp_path / "flat")
    for name, candidates, always in [("empty_always", torch.tensor([[3]]), torch.zeros(0, dtype=torch.int64)),
                                     ("no_columns", torch.zeros(4, 0, dtype=torch.int64), torch.tensor([2])),
                                     ("float_ids", torch.tensor([[10.7]]), torch.tensor([2])),
                                     ("bool_ids", torch.tensor([[True]]), torch.tensor([2]))]:
        save_file({"candidates": candidates, "always": always}, str(tmp_path / name), metadata={"format": FORMAT})
        with pytest.raises(ValueError, match="is corrupt"):
            Shortlist.load(tmp_path / name)
    build_shortlist(random_corpus(60, 50), 60, 60, 2, (0, 1)).save(tmp_path / "big")
    with pytest.raises(ValueError, match="has rows for 60 source ids, the model's vocabulary has 24"):
        Shortlist.load(tmp_path / "big", target_vocab_size=24)
    with pytest.raises(ValueError, match="has rows for 60 source ids, the model's vocabulary has 100"):
        Shortlist.load(tmp_path / "big", target_vocab_size=100)
    wide = Shortlist(torch.tensor([[70]] * 60), torch.tensor([2]))
    wide.save(tmp_path / "wide")
    with pytest.raises(ValueError, match="holds target id 70, outside the model's vocabulary of 60"):
        Shortlist.load(tmp_path / "wide", target_vocab_size=60)
    with pytest.raises(ValueError, match=r"does not keep EOS \(id 3\)"):
        Shortlist.load(tmp_path / "wide", eos_id=3)
    src = padded_sources(model, [3, 4])
    narrow = Shortlist(torch.full((5, 1), -1, dtype=torch.int64), torch.tensor([2]))
    with pytest.raises(ValueError, match=r"covers source ids \[0, 5\); the batch holds id"):
        model.translate(src, shortlist=narrow)
    with pytest.raises(TypeError, match="shortlist must be a fastformer Shortlist"):
        model.translate(src, shortlist=[2, 3])
    with pytest.raises(ValueError, match="got no sentence pairs"):
        build_shortlist([], 24, 24, 2)
    with pytest.raises(ValueError, match="a target id outside"):
        build_shortlist([([3], [30])], 24, 24, 2)


@pytest.mark.parametrize("ids,match", [
    ([5, 3, 2], "sorted without repeats"),
    ([3, 4], "must hold EOS"),
    ([2, 99], r"ids in \[0, vocab=24\)"),
])
def test_the_search_checks_the_vocabulary_it_is_given(ids, match, monkeypatch):
    model = make_model()
    monkeypatch.setattr("fastformer.decoding.search._shortlist_vocabulary", lambda *args: torch.tensor(ids))
    with pytest.raises(RuntimeError, match=match):
        model.translate(padded_sources(model, [3, 4]), shortlist=whole_vocabulary(24))


def test_cli_builds_a_shortlist_and_translates_and_evaluates_with_it(tiny_checkpoint, tmp_path, capsys):
    path = str(tiny_checkpoint[0])
    output = tmp_path / "shortlist.safetensors"
    main(["shortlist", "--checkpoint", path, "--source", str(BUNDLED_CORPUS / "train.en"), "--target",
          str(BUNDLED_CORPUS / "train.de"), "--output", str(output), "--max-sentences", "2000"])
    assert "2000 sentence pairs" in capsys.readouterr().out
    translator = fastformer.load_translator(path)
    shortlist = Shortlist.load(output, translator.model.config.vocab_size)
    sources = read_lines(BUNDLED_CORPUS / "valid.en")[:20]
    expected = translator.translate(sources, shortlist=shortlist)
    assert expected != translator.translate(sources)  # a random model: the shortlist changes its translations
    (tmp_path / "in.en").write_text("\n".join(sources) + "\n", encoding="utf-8")
    main(["translate", "--checkpoint", path, "--input", str(tmp_path / "in.en"), "--output", str(tmp_path / "out.de"),
          "--shortlist", str(output)])
    assert read_lines(tmp_path / "out.de") == expected
    # The vocabulary is each batch's union, so a sentence's output depends on its batch: a resume must batch alike.
    # A run stopped in its 2nd chunk by a line that is not UTF-8 keeps the 1st; the line mended, it resumes.
    broken = tmp_path / "broken.en"
    broken.write_bytes("\n".join(sources[:7]).encode() + b"\n\xff\n" + "\n".join(sources[8:]).encode() + b"\n")
    translate = ["translate", "--checkpoint", path, "--input", str(broken), "--output", str(tmp_path / "resumed.de"),
                 "--shortlist", str(output), "--chunk-lines", "5"]
    with pytest.raises(SystemExit, match="not valid UTF-8"):
        main(translate)
    broken.write_text("\n".join(sources) + "\n", encoding="utf-8")
    for option, value in (("--chunk-lines", "7"), ("--batch-tokens", "64")):
        with pytest.raises(SystemExit, match=rf"cannot resume .*: it was made with {option} \d+, this run has "
                                             rf"{option} {value}"):
            main(translate + ["--resume", option, value])
    main(translate + ["--resume"])
    straight = [option if option != str(tmp_path / "resumed.de") else str(tmp_path / "straight.de")
                for option in translate]
    main(straight)
    assert (tmp_path / "resumed.de").read_bytes() == (tmp_path / "straight.de").read_bytes()
    main(["evaluate", "--checkpoint", path, "--split", "valid", "--max-sentences", "20", "--shortlist", str(output)])
    assert "BLEU" in capsys.readouterr().out
    # An --output over what the command reads is refused before it writes anything.
    corpus = tmp_path / "train.en"
    corpus.write_bytes((BUNDLED_CORPUS / "train.en").read_bytes())
    with pytest.raises(SystemExit, match=f"--output {corpus} is --source {corpus}, which this command reads"):
        main(["shortlist", "--checkpoint", path, "--source", str(corpus), "--target", str(BUNDLED_CORPUS / "train.de"),
              "--output", str(corpus)])
    assert corpus.read_bytes() == (BUNDLED_CORPUS / "train.en").read_bytes()
    with pytest.raises(SystemExit, match=f"--output {output} is --shortlist {output}"):
        main(["evaluate", "--checkpoint", path, "--split", "valid", "--shortlist", str(output), "--output",
              str(output)])
    with pytest.raises(SystemExit, match="its directory does not exist"):
        main(["shortlist", "--checkpoint", path, "--source", str(corpus), "--target", str(BUNDLED_CORPUS / "train.de"),
              "--output", str(tmp_path / "missing" / "shortlist.safetensors")])
    # A run's own checkpoint names are refused: a shortlist over checkpoint_best.pt destroyed it.
    for name, match in (("checkpoint_00000100.pt", "a training step's checkpoint"),
                        ("checkpoint_best.pt", "a run.s best checkpoint")):
        with pytest.raises(SystemExit, match=f"--output {tmp_path / name} is named as {match}"):
            main(["shortlist", "--checkpoint", path, "--source", str(corpus), "--target",
                  str(BUNDLED_CORPUS / "train.de"), "--output", str(tmp_path / name)])
        assert not (tmp_path / name).exists()
    # evaluate batches as --batch-tokens says (with a shortlist, a batch's union is its vocabulary).
    with pytest.raises(SystemExit, match="batch_tokens must be >= 1, got 0"):
        main(["evaluate", "--checkpoint", path, "--split", "valid", "--batch-tokens", "0"])
    main(["evaluate", "--checkpoint", path, "--split", "valid", "--max-sentences", "20", "--shortlist", str(output),
          "--batch-tokens", "40", "--output", str(tmp_path / "small_batches.de")])
    assert read_lines(tmp_path / "small_batches.de") == translator.translate(sources, shortlist=shortlist,
                                                                            batch_tokens=40)
