"""Polysemy: layer 0 is context-free (the same vector for the same word), the biLSTM layers are not."""

import json
import re

import numpy as np
import pytest
import torch

from elmo_pipeline.cli.main import main
from elmo_pipeline.cli.downstream import read_sense_file
from elmo_pipeline.downstream.similarity import cosine_matrix, find_word, word_similarity
from support import damaged_gzip

# Written for this test: the same surface form in every sentence of a set, two senses each.
APPLE = [
    ("fruit", "Apple pie is my favourite dessert in the autumn ."),
    ("fruit", "Apple trees need a cold winter before they bear fruit ."),
    ("company", "Apple released a new phone and a new laptop today ."),
    ("company", "Apple shares rose after the company reported strong quarterly earnings ."),
]
BAOFU = [  # 包袱: a burden / a cloth bundle; right-hand contexts matched across the senses
    ("burden", "他 终于 放下 了 思想 包袱 。"),
    ("burden", "不要 把 过去 的 错误 当作 包袱 背 在 身上 。"),
    ("bundle", "她 手里 提着 一个 蓝色 的 包袱 。"),
    ("bundle", "他 把 衣服 包 成 一个 包袱 背 在 身上 。"),
]


@pytest.mark.parametrize("word, rows", [("Apple", APPLE), ("包袱", BAOFU)])
def test_layer0_is_context_free_and_lstm_layers_are_not(reference_model, word, rows):
    senses = [s for s, _ in rows]
    result = word_similarity(reference_model, [t.split() for _, t in rows], word, senses)
    assert result.cosine.shape == (3, 4, 4)
    for i in range(1, 4):
        np.testing.assert_array_equal(result.vectors[0, i], result.vectors[0, 0])  # bit-identical
    np.testing.assert_allclose(result.cosine[0], 1.0, atol=1e-6)
    off_diagonal = ~np.eye(4, dtype=bool)
    for j in (1, 2):
        assert np.all(result.cosine[j][off_diagonal] < 0.9999), result.cosine[j]
        np.testing.assert_allclose(np.diag(result.cosine[j]), 1.0, atol=1e-9)
    rows_ = result.summary()
    assert rows_[0]["same_sense"] == pytest.approx(1) and rows_[0]["gap"] == pytest.approx(0, abs=1e-6)
    assert len(result.pairs(True)) == 2 and len(result.pairs(False)) == 4
    assert "same sense" in result.format() and "layer 2 cosine" in result.format(matrices=True)


def test_default_model_layer0_is_context_free_too():
    from elmo_pipeline.model.bilm import BiLM

    # the default model ships in the package: its absence is a failure here, not a skip
    model = BiLM.load(None).eval()
    result = word_similarity(model, [t.split() for _, t in APPLE], "Apple", [s for s, _ in APPLE])
    np.testing.assert_allclose(result.cosine[0], 1.0, atol=1e-6)
    assert np.all(result.cosine[1:][:, ~np.eye(4, dtype=bool)] < 0.9999)


def test_helpers():
    assert find_word(["an", "Apple"], "apple", ignore_case=True) == 1
    with pytest.raises(ValueError, match="not a token"):
        find_word(["an", "Apple"], "apple")
    v = np.array([[1.0, 0.0], [1.0, 1.0]])
    import torch

    np.testing.assert_allclose(cosine_matrix(torch.tensor(v)).numpy(), [[1, 2 ** -0.5], [2 ** -0.5, 1]])
    # a vector with itself, and with its negation: float64 rounding gave 1.0000000000000004
    row = [-0.04680609169528838, 0.1667640789100624, 0.8162257703906703, 0.009373711634780513]
    w = torch.tensor([row, [-x for x in row]], dtype=torch.float64)
    unclamped = (w / w.norm(dim=-1, keepdim=True)) @ (w / w.norm(dim=-1, keepdim=True)).T
    assert float(unclamped.abs().max()) > 1.0  # the case this covers
    assert cosine_matrix(w).tolist() == [[1.0, -1.0], [-1.0, 1.0]]


@pytest.mark.parametrize("bad, says", [
    ("a bank", "sentence 0 is a str"),  # was embedded as 6 one-character tokens, "a" found at 0
    ({"a", "bank"}, "sentence 0 is a set"),  # no order: the word's position changed with the hash seed
])
def test_a_sentence_that_is_not_a_token_list_is_refused_not_read_as_characters(reference_model, bad, says):
    with pytest.raises(TypeError, match=says):
        word_similarity(reference_model, [bad, ["a", "river"]], "a")
    # the same sentence as a list of tokens: two tokens, the word at 0
    result = word_similarity(reference_model, [["a", "bank"], ["the", "a", "river"]], "a")
    assert result.sentences == [["a", "bank"], ["the", "a", "river"]] and result.positions == [0, 1]
    np.testing.assert_array_equal(result.vectors[0, 0], result.vectors[0, 1])


def test_senses_or_a_word_of_the_wrong_type_are_named(reference_model):
    """senses="ff" for two sentences was taken as the senses 'f' and 'f' (every pair same-sense), a
    generator of senses failed on len(), and a word that is not a str was said to be missing from
    sentence s0."""
    sentences = [["a", "bank"], ["the", "a", "river"]]
    for senses, says in (("ff", "not a str ('ff')"), ((s for s in "fr"), "not a generator")):
        with pytest.raises(TypeError, match=re.escape(f"senses is a list of labels, one per sentence, {says}")):
            word_similarity(reference_model, sentences, "a", senses=senses)
    with pytest.raises(TypeError, match=re.escape("word must be a str, got list (['a'])")):
        word_similarity(reference_model, sentences, ["a"])
    result = word_similarity(reference_model, sentences, "a", senses=("fin", "geo"))
    assert result.senses == ["fin", "geo"] and result.positions == [0, 1]
    with pytest.raises(TypeError, match=re.escape("senses is a list of labels, one per sentence, not a set")):
        word_similarity(reference_model, sentences, "a", senses={"fin", "geo"})  # no order to pair by
    # labels as a numpy array (a DataFrame column's .values) were taken before these checks, and still are
    labelled = word_similarity(reference_model, sentences, "a", senses=np.array(["fin", "geo"]))
    assert labelled.senses == ["fin", "geo"] and labelled.summary() == result.summary()
    np.testing.assert_array_equal(labelled.cosine, result.cosine)


def test_cli_with_a_sense_file(tmp_path, capsys, elmo_fixture_dir):
    tsv = tmp_path / "apple.tsv"
    tsv.write_text("# comment\n" + "".join(f"{s}\t{t}\n" for s, t in APPLE), encoding="utf-8")
    texts, senses, lines = read_sense_file(str(tsv))
    assert senses == ["fruit", "fruit", "company", "company"] and texts[0].startswith("Apple pie")
    assert lines == [2, 3, 4, 5]  # after the comment
    model = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    out = tmp_path / "sim.json"
    # spaCy tokenization (no --pretokenized): "Apple" is a token of every sentence
    assert main(["similarity", "--word", "Apple", "--file", str(tsv), "--model", model, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cross sense" in printed and printed.count("\n") > 8
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved["word"] == "Apple" and len(saved["summary"]) == 3 and saved["summary"][0]["all_pairs"] == pytest.approx(1.0)


def test_sense_labels_are_taken_without_surrounding_spaces(reference_model, tmp_path, elmo_fixture_dir):
    """" one" after a comma (or "one " before a tab) was a sense of its own: the two "one" sentences
    made no same-sense pair and every pair was scored as cross-sense."""
    sentences = ["a b", "a c", "x a"]
    want = word_similarity(reference_model, [s.split() for s in sentences], "a", ["one", "one", "two"]).summary()
    assert want[1]["same_sense"] is not None and want[1]["cross_sense"] is not None
    model = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    tsv = tmp_path / "senses.tsv"
    tsv.write_text("one\ta b\n one\ta c\ntwo \tx a\n", encoding="utf-8")
    assert read_sense_file(str(tsv))[1] == ["one", "one", "two"]
    for given in (["--senses", "one, one , two"], ["--file", str(tsv)]):
        out = tmp_path / "sim.json"
        argv = [*sentences] if given[0] == "--senses" else []
        assert main(["similarity", "--word", "a", *argv, *given, "--pretokenized", "--model", model,
                     "--json", str(out)]) == 0
        saved = json.loads(out.read_text(encoding="utf-8"))
        assert saved["senses"] == ["one", "one", "two"]
        for row, expected in zip(saved["summary"], want):
            assert row["same_sense"] == pytest.approx(expected["same_sense"], abs=1e-9)
            assert row["cross_sense"] == pytest.approx(expected["cross_sense"], abs=1e-9)


def test_a_sentence_without_the_word_is_named_by_its_number(reference_model, capsys, elmo_fixture_dir):
    with pytest.raises(ValueError, match=re.escape("sentence s2: 'a' is not a token of: x | y")):
        word_similarity(reference_model, [["a"], ["b", "a"], ["x", "y"]], "a")
    # an empty sentence said only "'a' is not a token of: ", naming none
    model = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    assert main(["similarity", "--word", "a", "a b", "", "--pretokenized", "--model", model]) == 2
    err = capsys.readouterr().err
    assert "sentence s1: 'a' is not a token of an empty sentence" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, named", [
    (["--word", "bank", "the bank rose", "a river b\udcffank"], "sentence s1 'a river b\\udcffank'"),
    (["--word", "b\udcffank", "the bank rose", "a river bank"], "--word 'b\\udcffank'"),
    (["--word", "bank", "the bank\x00 rose", "a river bank", "--pretokenized"], "sentence s0 'the bank\\x00 rose'"),
])
def test_an_argument_that_is_not_utf8_is_named_before_the_model_loads(capsys, argv, named):
    """Bytes that are not UTF-8 reach Python as lone surrogates: spaCy failed on them naming no
    sentence, and with --pretokenized the embedding dropped them."""
    assert main(["similarity", *argv, "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert f"{named} is not UTF-8 text (or holds NUL); give it in UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("option, says", [
    ("--json", "--json '' names no file; give a path or URL"),
    ("--file", "--file '' names no file; give a path or URL"),
    ("--senses", "--senses '': a sense label is empty or blank"),
])
def test_an_empty_json_file_or_senses_is_refused_not_dropped(tmp_path, capsys, elmo_fixture_dir, option, says):
    """`--json "$OUT"` with the variable unset: an empty value was taken for the option left out, so
    the command ended with status 0 and wrote no JSON (or used no senses, or the argument sentences)."""
    model = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    assert main(["similarity", "--word", "a", "a b", "x a", "--pretokenized", "--model", model, option, ""]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"elmo-pipeline similarity: error: {says}" in captured.err


@pytest.mark.parametrize("word", ["", " "])
def test_an_empty_word_is_refused_by_name(capsys, elmo_fixture_dir, word):
    # `--word "$W"` with the variable unset was said to be no token of the first sentence
    model = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    assert main(["similarity", "--word", word, "a b", "x a", "--pretokenized", "--model", model]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"elmo-pipeline similarity: error: --word {word!r} is empty or blank; give the word to compare" in captured.err


def test_the_json_is_never_the_sentence_file_or_a_model_file(tmp_path, capsys, elmo_fixture_dir):
    """`--json` naming the `--file` (or a link to it), or a file of the model, replaced that file with
    the JSON (exit 0): the sentences or the model's weights were lost."""
    tsv = tmp_path / "apple.tsv"
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in APPLE), encoding="utf-8")
    (tmp_path / "link.tsv").symlink_to(tsv)
    for name in ("options.json", "lm_weights.hdf5"):
        (tmp_path / name).write_bytes((elmo_fixture_dir / name).read_bytes())
    pair = f"{tmp_path / 'options.json'},{tmp_path / 'lm_weights.hdf5'}"
    before = {p: p.read_bytes() for p in (tsv, tmp_path / "options.json", tmp_path / "lm_weights.hdf5")}
    for json_out, what in ((tsv, "the --file of sentences"), (tmp_path / "link.tsv", "the --file of sentences"),
                           (tmp_path / "lm_weights.hdf5", f"the model's file {tmp_path / 'lm_weights.hdf5'}")):
        assert main(["similarity", "--word", "Apple", "--file", str(tsv), "--pretokenized", "--model", pair,
                     "--json", str(json_out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert f"error: output {json_out} is {what}, which this command reads" in captured.err
    assert {p: p.read_bytes() for p in before} == before


def test_a_sentence_file_of_fewer_than_two_sentences_is_named_before_the_model_loads(tmp_path, capsys):
    # an empty --file (or one of comments only) said "give at least two sentences", after the model
    # loaded, naming neither the file nor what it held
    for name, text, held in (("empty.tsv", "", 0), ("one.tsv", "# only one\n\na b\n", 1)):
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert main(["similarity", "--word", "a", "--file", str(tmp_path / name), "--pretokenized",
                     "--model", "/no/such/model"]) == 2
        assert (f"error: --file {tmp_path / name} holds {held} sentences (blank lines and lines starting with # "
                "are skipped); give at least two") in capsys.readouterr().err
    assert main(["similarity", "--word", "a", "a b", "--pretokenized", "--model", "/no/such/model"]) == 2
    assert "error: give at least two sentences (1 given)" in capsys.readouterr().err


def test_a_sentence_of_the_file_without_the_word_is_named_by_its_line_before_the_model_loads(tmp_path, capsys):
    # named "sentence s1", its place among the lines that are not comments or blank, after the model loaded
    tsv = tmp_path / "senses.tsv"
    tsv.write_text("# apple\n\nfruit\tI ate an apple today\n# the company\ncompany\tApple sells phones\n",
                   encoding="utf-8")
    assert main(["similarity", "--word", "apple", "--file", str(tsv), "--pretokenized",
                 "--model", "/no/such/model"]) == 2
    assert (f"error: --file {tsv}, line 5 (s1): 'apple' is not a token of: Apple | sells | phones"
            in capsys.readouterr().err)
    assert main(["similarity", "--word", "a", "a b", "b c", "--senses", "x,y,z", "--pretokenized",
                 "--model", "/no/such/model"]) == 2
    assert "error: --senses gives 3 senses for 2 sentences; give one per sentence" in capsys.readouterr().err


def test_sentences_given_as_a_generator_are_named_as_embed_names_them(reference_model):
    # "object of type 'generator' has no len()": the count of sentences came before embed's check
    sentences = [["a", "bank"], ["the", "a", "river"]]
    with pytest.raises(TypeError, match=r"^embed takes a list of sentences \(each a list of token strings\), got a "
                                        r"generator: pass list\(\.\.\.\) of it, in sentence order"):
        word_similarity(reference_model, (s for s in sentences), "a")
    assert word_similarity(reference_model, sentences, "a").positions == [0, 1]


def test_an_empty_lang_is_refused_not_taken_for_english(capsys):
    """`--lang "$LANG_CODE"` with the variable unset tokenized the sentences as English."""
    from elmo_pipeline.cli.main import main

    assert main(["similarity", "--word", "bank", "the bank", "a bank", "--lang", "", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "--lang '' is empty: give a spaCy language code" in err and "Traceback" not in err


def test_a_sentence_longer_than_max_sentence_tokens_is_named_before_the_model_loads(reference_model, tmp_path,
                                                                                     capsys, elmo_fixture_dir):
    # embedded whole: a 60,112-token line failed in torch's allocator ("can't allocate memory: you
    # tried to allocate 984907776 bytes"), naming no sentence
    lines = tmp_path / "lines.txt"
    lines.write_text("a bank here\n\nthe bank of a long river\n", encoding="utf-8")
    assert main(["similarity", "--word", "bank", "--file", str(lines), "--pretokenized", "--max-sentence-tokens",
                 "5", "--model", "/no/such/model"]) == 2
    assert (f"error: --file {lines}, line 3 (s1): 6 tokens, more than --max-sentence-tokens 5 (a sentence is "
            "embedded whole" in capsys.readouterr().err)
    model = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    out = tmp_path / "sim.json"
    assert main(["similarity", "--word", "bank", "--file", str(lines), "--pretokenized", "--max-sentence-tokens",
                 "6", "--model", model, "--json", str(out)]) == 0
    want = word_similarity(reference_model, [["a", "bank", "here"], "the bank of a long river".split()], "bank")
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert np.allclose(saved["cosine"], want.cosine, atol=1e-6)  # rounded to 6 places


def test_sentences_are_embedded_in_batches_of_bounded_padded_tokens(reference_model):
    # one call took every sentence padded to the longest: 100 sentences beside one of 300 tokens
    # were 101 x 302 padded tokens at once
    sentences = [["a", "bank", f"w{i}"] for i in range(100)] + [["bank"] + [f"x{k}" for k in range(299)]]
    calls = []
    real_embed = reference_model.embed

    def recording_embed(batch, *args, **kwargs):  # the model's own embed, its calls' sizes noted
        calls.append(len(batch) * (max(len(s) for s in batch) + 2))
        return real_embed(batch, *args, **kwargs)

    reference_model.embed = recording_embed
    try:
        result = word_similarity(reference_model, sentences, "bank")
    finally:
        del reference_model.embed
    assert calls == [100 * 5, 302]  # the short ones together, the long one alone
    with torch.no_grad():
        alone = [reference_model.embed([s]).layers[:, 0, s.index("bank")] for s in (sentences[0], sentences[-1])]
    np.testing.assert_allclose(result.vectors[:, 0], alone[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(result.vectors[:, -1], alone[1].numpy(), atol=1e-6)


def test_more_sentences_than_max_sentences_are_refused_before_the_model_loads(tmp_path, capsys):
    # every pair is compared: 2,000 sentences with --json peaked at 2.2 GB (195 MB of JSON)
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"a bank {k}\n" for k in range(4)), encoding="utf-8")
    assert main(["similarity", "--word", "bank", "--file", str(lines), "--pretokenized", "--max-sentences", "3",
                 "--model", "/no/such/model"]) == 2
    assert (f"error: --file {lines} holds 4 sentences, more than --max-sentences 3 (every pair is compared"
            in capsys.readouterr().err)
    assert main(["similarity", "--word", "bank", "a bank", "the bank", "one bank", "--pretokenized",
                 "--max-sentences", "2", "--model", "/no/such/model"]) == 2
    assert "error: given: 3 sentences, more than --max-sentences 2" in capsys.readouterr().err


def test_a_file_past_max_sentences_is_counted_not_held(tmp_path, capsys):
    """The sentences of --file past --max-sentences are counted and checked, not held: the peak that
    tracemalloc sees for a 2 MB file of 20,000 lines stays under 512 KB (the whole file was held, as
    its text and a list entry per line, before it was refused for its count), and the count is the file's."""
    import tracemalloc

    lines = tmp_path / "lines.txt"
    lines.write_text("a bank\nthe bank\none bank\n", encoding="utf-8")  # what a first run imports is not held
    assert main(["similarity", "--word", "bank", "--file", str(lines), "--pretokenized", "--max-sentences", "2"]) == 2
    lines.write_text("".join(f"a bank {k} " + "x" * 90 + "\n" for k in range(20_000)), encoding="utf-8")
    capsys.readouterr()
    tracemalloc.start()
    try:
        assert main(["similarity", "--word", "bank", "--file", str(lines), "--pretokenized",
                     "--max-sentences", "10"]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lines.stat().st_size > 2_000_000 and peak < 512 * 1024, peak
    assert f"error: --file {lines} holds 20,000 sentences, more than --max-sentences 10" in capsys.readouterr().err
    # a line past the bound is still read and checked: its error is the one given
    with lines.open("ab") as f:
        f.write(b"a bank \xff\n")
    assert main(["similarity", "--word", "bank", "--file", str(lines), "--pretokenized", "--max-sentences", "10"]) == 2
    assert f"error: {lines}, line 20001: invalid UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["damaged.txt.gz", "cut.txt.xz"])
def test_a_file_that_cannot_be_decompressed_is_one_line_naming_it(tmp_path, capsys, name):
    # a damaged .gz ended in zlib.error's traceback, a truncated .xz in EOFError's, naming no file
    import lzma

    text = b"Compressed line one.\nCompressed line two.\n" * 50
    if name.endswith(".gz"):
        data = damaged_gzip(text)
        said = "zlib.error: Error -3 while decompressing data: "
    else:
        data = lzma.compress(text)[:40]
        said = "EOFError: xz file ended before the end of its last stream"
    path = tmp_path / name
    path.write_bytes(data)
    assert main(["similarity", "--word", "line", "--file", str(path), "--pretokenized"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elmo-pipeline similarity: error: cannot read {path}: {said}") and err.count("\n") == 1, err
