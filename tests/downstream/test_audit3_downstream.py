"""From the audit of the command line (probe and similarity): what a rerun of probe removes, the
model behind reused features, CoNLL-U's `_`, the labelled and sense files' lines, --seed, and
what similarity refuses or writes."""

import gzip
import importlib.util
import json
import shutil
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from elmo_pipeline.cli.downstream import read_sense_file
from elmo_pipeline.cli.main import main
from elmo_pipeline.downstream import similarity
from elmo_pipeline.downstream.conll import ConllError, LabelledSentence, read_conll2003, read_conllu, read_labelled
from elmo_pipeline.downstream.dataset import ParquetFeatureDataset
from elmo_pipeline.downstream.probe import (LabelTable, ProbeConfig, baselines, check_labelled, check_lengths,
                                            train_probes)
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.layers_digest import layers_sha256
from support import strict_json
from test_downstream_probe import mini_ewt, synthetic_split

UPOS = 3  # the UPOS column of a CoNLL-U line


def conllu_line(number, form, upos, lemma=None):
    return f"{number}\t{form}\t{form.lower() if lemma is None else lemma}\t{upos}\t_\t_\t0\troot\t_\t_\n"


def with_upos(src, dst, relabel):
    """`src` with each word's UPOS replaced by `relabel(upos, k)` (k counts the words)."""
    lines, k = [], 0
    for line in src.read_text(encoding="utf-8").splitlines(keepends=True):
        fields = line.rstrip("\n").split("\t")
        if len(fields) == 10 and fields[0].isdigit():
            fields[UPOS] = relabel(fields[UPOS], k)
            k += 1
            line = "\t".join(fields) + "\n"
        lines.append(line)
    dst.write_text("".join(lines), encoding="utf-8")
    return dst


@pytest.fixture(scope="module")
def ud(tmp_path_factory):
    """20 train / 8 dev sentences of UD EWT, the reference model, and a probe run on them."""
    root = tmp_path_factory.mktemp("audit3")
    data, model = mini_ewt(root, 20, 8)
    out = root / "out"
    assert main(["probe", str(data), "--output", str(out), "--model", model, "--epochs", "1", "--threads", "1"]) == 0
    return data, out, model


def probe_args(data, out, model, *extra):
    return ["probe", str(data), "--output", str(out), "--model", model, "--epochs", "1", "--threads", "1", *extra]


# -- 3: a rerun removes what a run wrote, by name, and the old report before the new features ---------
def test_a_rerun_removes_only_the_runs_files_and_a_failed_one_leaves_no_old_report(ud, tmp_path, monkeypatch,
                                                                                      capsys):
    data, first, model = ud
    out = tmp_path / "out"
    shutil.copytree(first, out)
    train = out / "features" / "train"
    (shard,) = train.glob("sentences-*.parquet")
    (train / "mine.txt").write_text("mine")
    (train / "notes").mkdir()
    (train / "notes" / "keep.txt").write_text("keep")
    backup = shard.read_bytes()
    (train / "backup.parquet").write_bytes(backup)  # the user's copy: neither deleted nor read as features
    (train / "sentences-00001-of-00002.parquet").write_bytes(b"a shard of an earlier two-worker run")
    (train / f"beam-temp-sentences-{'0' * 32}").mkdir()
    (train / f"beam-temp-sentences-{'0' * 32}" / "part").write_bytes(b"left by a killed run")

    def fail(*args, **kwargs):
        raise RuntimeError("training failed")

    monkeypatch.setattr("elmo_pipeline.pipelines.probe.train_probes", fail)
    assert main(probe_args(data, out, model)) == 2
    assert "training failed" in capsys.readouterr().err
    # the new features are there, and no report, mix or chart of the earlier run beside them
    assert not any((out / name).exists() for name in ("report.json", "mix.json", "probe.png"))
    assert sorted(p.name for p in train.iterdir()) == ["backup.parquet", "mine.txt", "notes", shard.name]
    assert (train / "notes" / "keep.txt").read_text() == "keep" and (train / "mine.txt").read_text() == "mine"

    monkeypatch.undo()
    assert main(probe_args(data, out, model)) == 0
    report, earlier = (strict_json((d / "report.json").read_text()) for d in (out, first))
    assert report["train_tokens"] == earlier["train_tokens"] > 0  # backup.parquet was not read (twice the rows)
    assert report["accuracy"] == earlier["accuracy"]
    assert (train / "backup.parquet").read_bytes() == backup


def test_a_split_path_that_is_a_file_is_refused_before_anything_goes(ud, tmp_path, capsys):
    data, first, model = ud
    out = tmp_path / "out"
    shutil.copytree(first, out)
    shutil.rmtree(out / "features" / "dev")
    (out / "features" / "dev").write_text("a file of the user's")
    assert main(probe_args(data, out, model)) == 2
    assert f"{out / 'features' / 'dev'} is a file" in capsys.readouterr().err
    assert (out / "features" / "dev").read_text() == "a file of the user's"
    assert (out / "report.json").read_bytes() == (first / "report.json").read_bytes()


def test_probe_refuses_the_fused_kernel_for_a_model_with_clips_before_the_job(ud, tmp_path, capsys):
    data, first, model = ud
    out = tmp_path / "out"
    shutil.copytree(first, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(probe_args(data, out, model, "--kernel", "fused")) == 2
    assert "kernel 'fused' (torch's LSTM op) has no cell or projection clips" in capsys.readouterr().err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# -- 4: --reuse-features with another model ---------------------------------------------------------
def test_reused_features_must_be_of_the_model_given(ud, tmp_path, capsys):
    data, first, model = ud
    out = tmp_path / "out"
    shutil.copytree(first, out)
    made_with = BiLM.load(model, cache_size=0).checksum
    other = BiLM.load(None, cache_size=0).checksum  # the embedded default model
    assert made_with != other
    assert main(["probe", str(data), "--output", str(out), "--epochs", "1", "--reuse-features"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'features' / 'train'} holds features extracted with the model {model!r}" in err, err
    assert f"(sha256 {made_with[:12]}), not with the embedded default model (no --model) (sha256 {other[:12]})" in err
    assert (out / "report.json").read_bytes() == (first / "report.json").read_bytes()  # not rewritten
    assert main(probe_args(data, out, model, "--reuse-features")) == 0
    assert strict_json((out / "report.json").read_text())["accuracy"] == strict_json(
        (first / "report.json").read_text())["accuracy"]


def test_reused_features_may_be_given_the_same_model_read_from_other_files(ud, tmp_path):
    # the folder import-allennlp makes of the two original files: another checksum, refused as
    # another model, though its layers are the features' bit for bit
    data, first, model = ud
    out = tmp_path / "out"
    shutil.copytree(first, out)
    options, weights = model.split(",")
    imported = tmp_path / "imported"
    assert main(["import-allennlp", "--options", options, "--weights", weights, "--output", str(imported)]) == 0
    assert BiLM.load(str(imported)).checksum != BiLM.load(model).checksum
    assert main(probe_args(data, out, str(imported), "--reuse-features")) == 0
    report = strict_json((out / "report.json").read_text())
    assert report["accuracy"] == strict_json((first / "report.json").read_text())["accuracy"]
    assert report["model"]["layers_sha256"] == layers_sha256(BiLM.load(str(imported)))


@pytest.mark.parametrize("given, says", [
    (["--layout", "token"], "--layout token"),
    (["--dtype", "float32", "--kernel", "exact"], "--kernel exact, --dtype float32"),
    (["--batch-tokens", "64"], "--batch-tokens 64"),
    (["--direct_num_workers", "2"], "--direct_num_workers 2"),
])
def test_reuse_features_refuses_the_extraction_options_it_would_ignore(ud, tmp_path, capsys, given, says):
    data, first, model = ud
    out = tmp_path / "out"
    shutil.copytree(first, out)
    assert main(probe_args(data, out, model, "--reuse-features", *given)) == 2
    assert f"--reuse-features trains on the features already extracted, so {says} would change nothing" in \
        capsys.readouterr().err
    assert (out / "report.json").read_bytes() == (first / "report.json").read_bytes()


def test_probe_without_matplotlib_stops_before_any_work_with_the_install_line(ud, tmp_path, capsys, monkeypatch):
    """It used to extract and train, then fail at the chart (matplotlib is an extra)."""
    data, _, model = ud
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "out"
    assert main(probe_args(data, out, model)) == 2
    assert ("probe draws probe.png with matplotlib, which is not installed: pip install 'elmo-pipeline[downstream]'"
            in capsys.readouterr().err)
    assert not out.exists()


# -- 5: CoNLL-U `_` is no label ---------------------------------------------------------------------
def test_conllu_underscore_is_an_unspecified_label(tmp_path):
    path = tmp_path / "x.conllu"
    path.write_text(conllu_line(1, "Hi", "INTJ") + conllu_line(2, "there", "_") + conllu_line(3, "_", "SYM", "_")
                    + "\n", encoding="utf-8")
    (s,) = read_conllu(str(path))
    assert s.tokens == ("Hi", "there", "_") and s.labels == ("INTJ", None, "SYM")  # still a token, no label
    assert next(read_conllu(str(path), "lemma")).labels == ("hi", "there", "_")  # the lemma of the FORM `_`
    assert next(read_conllu(str(path), "feats")).labels == (None, None, None)
    conll = tmp_path / "x.conll"
    conll.write_text("a X _\nb Y O\n", encoding="utf-8")
    assert next(read_conll2003(str(conll), 1)).labels == ("X", "Y")
    assert next(read_conll2003(str(conll))).labels == ("_", "O")  # CoNLL-2003 gives `_` no meaning


def test_unspecified_labels_are_neither_trained_nor_scored(tmp_path):
    rng = np.random.default_rng(0)
    means = 2.0 * rng.standard_normal((3, 8)).astype(np.float32)
    train = synthetic_split(tmp_path / "train", "train", 40, means, rng)
    dev = synthetic_split(tmp_path / "dev", "dev", 10, means, rng)
    # sentence 0 of train has no label at all (a batch of it alone would be a NaN loss), the others one in three
    train = [LabelledSentence(s.tokens, tuple(None if i == 0 or k % 3 == 0 else lab for k, lab in enumerate(s.labels)))
             for i, s in enumerate(train)]
    dev = [LabelledSentence(s.tokens, tuple(None if k % 2 else lab for k, lab in enumerate(s.labels))) for s in dev]
    names = ["L0", "L1", "L2"]
    result = train_probes(
        ParquetFeatureDataset(str(tmp_path / "train"), batch_sentences=1),
        ParquetFeatureDataset(str(tmp_path / "dev"), batch_sentences=64),
        LabelTable("train", train, names), LabelTable("dev", dev, names), 3,
        ProbeConfig(epochs=1, batch_sentences=1, shuffle_buffer=0), show_progress=False)
    assert all(np.isfinite(result.loss_per_epoch))
    assert result.train_tokens == sum(lab is not None for s in train for lab in s.labels)
    assert result.dev_tokens == sum(lab is not None for s in dev for lab in s.labels)
    assert result.train_tokens < sum(len(s.tokens) for s in train)


def test_baselines_and_checks_leave_unspecified_labels_out():
    train = [LabelledSentence(("a", "b", "a", "c"), ("X", None, "X", "Y"))]
    dev = [LabelledSentence(("a", "b", "c"), ("X", None, "Y"))]
    assert baselines(train, dev) == {"majority_label": 0.5, "word_majority_label": 1.0}
    files = {"train": "t.conllu", "dev": "d.conllu"}
    check_labelled({"train": train, "dev": dev}, files)
    one = [LabelledSentence(("a", "b"), ("X", None))]
    with pytest.raises(ValueError, match=r"t.conllu has only the label 'X' .*at least two labels"):
        check_labelled({"train": one, "dev": dev}, files)
    with pytest.raises(ValueError, match=r"d.conllu has no labelled tokens .*'_', unspecified"):
        check_labelled({"train": train, "dev": [LabelledSentence(("a",), (None,))]}, files)


def test_probe_refuses_an_unannotated_label_column(ud, tmp_path, capsys):
    data, _, model = ud
    train = with_upos(data / "mini-train.conllu", tmp_path / "train.conllu", lambda upos, k: "_")
    out = tmp_path / "out"
    assert main(["probe", "--train", str(train), "--dev", str(data / "mini-dev.conllu"), "--output", str(out),
                 "--model", model]) == 2
    assert f"train file {train} has no labelled tokens" in capsys.readouterr().err
    one = with_upos(data / "mini-train.conllu", tmp_path / "one.conllu", lambda upos, k: "NOUN" if k % 2 else "_")
    assert main(["probe", "--train", str(one), "--dev", str(data / "mini-dev.conllu"), "--output", str(out),
                 "--model", model]) == 2
    assert "has only the label 'NOUN'" in capsys.readouterr().err
    assert not out.exists()  # refused before the extraction


def test_probe_report_counts_the_unlabelled_tokens(ud, tmp_path):
    data, first, model = ud
    train = with_upos(data / "mini-train.conllu", tmp_path / "train.conllu", lambda upos, k: "_" if k % 4 else upos)
    out = tmp_path / "out"
    assert main(["probe", "--train", str(train), "--dev", str(data / "mini-dev.conllu"), "--output", str(out),
                 "--model", model, "--epochs", "1", "--threads", "1"]) == 0
    report = strict_json((out / "report.json").read_text())
    total = sum(len(s.tokens) for s in read_conllu(str(train)))
    labelled = sum(lab is not None for s in read_conllu(str(train)) for lab in s.labels)
    assert report["task"]["unlabelled_tokens"] == {"train": total - labelled, "dev": 0}
    # dev labels the thinned train file lost: scored as errors, and counted so a reader knows why
    known = {lab for s in read_conllu(str(train)) for lab in s.labels if lab is not None}
    unseen = Counter(lab for s in read_conllu(str(data / "mini-dev.conllu")) for lab in s.labels if lab not in known)
    assert unseen and report["task"]["dev_labels_unseen_in_train"] == dict(sorted(unseen.items()))
    assert report["train_tokens"] == labelled < total and "_" not in report["task"]["labels"]
    assert report["dev_tokens"] == strict_json((first / "report.json").read_text())["dev_tokens"]
    assert pq.read_table(out / "features" / "train").num_rows == 20  # every sentence still embedded


# -- 12, 18: options checked before the extraction, with messages naming them ------------------------
@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999999"])
def test_probe_seed_is_bounded_as_it_is_parsed(ud, tmp_path, capsys, seed):
    data, _, model = ud
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        main(probe_args(data, out, model, "--seed", seed))
    assert stopped.value.code == 2
    assert f"argument --seed: must be an integer from 0 to 4294967295, got {seed}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("extra, says", [
    (["--format", "conll2003", "--label", "upos"], "--label 'upos': {train} is read as CoNLL-2003, whose label is a "
                                                   "column index"),
    (["--label", "3"], "--label '3': a CoNLL-U label is one of the columns"),
])
def test_probe_label_that_does_not_fit_the_format_names_label(ud, tmp_path, capsys, extra, says):
    data, _, model = ud
    out = tmp_path / "out"
    assert main(probe_args(data, out, model, *extra)) == 2
    err = capsys.readouterr().err
    assert says.format(train=data / "mini-train.conllu") in err and "Traceback" not in err, err
    assert not out.exists()


def test_probe_config_bounds_the_seed():
    assert ProbeConfig(seed=2**32 - 1).seed == 2**32 - 1
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match=rf"--seed must be an integer from 0 to 4294967295, got {bad}"):
            ProbeConfig(seed=bad)


def test_conll2003_label_that_is_a_name_is_explained(tmp_path):
    path = tmp_path / "eng.train"
    path.write_text("EU NNP B-ORG\nrejects VBZ O\n", encoding="utf-8")
    with pytest.raises(ConllError, match=rf"--label 'upos': {path} is read as CoNLL-2003, whose label is a column "):
        list(read_labelled(str(path), "conll2003", "upos"))
    assert [s.labels for s in read_labelled(str(path), "conll2003", "1")] == [("NNP", "VBZ")]


# -- 18, 19: the lines of a labelled file ------------------------------------------------------------
@pytest.mark.parametrize("line, says", [
    (conllu_line("abc", "word", "NOUN"), "ID 'abc' is not a word (1), a multiword token (1-2) or an empty node"),
    (conllu_line("3-", "word", "NOUN"), "ID '3-' is not a word"),
    (conllu_line("3.", "word", "NOUN"), "ID '3.' is not a word"),
    (conllu_line("", "word", "NOUN"), "ID '' is not a word"),
    ("3\t\tx\tNOUN\t_\t_\t0\troot\t_\t_\n", "FORM '' is empty or blank"),
    (conllu_line(3, " ", "NOUN", "x"), "FORM ' ' is empty or blank"),
    (conllu_line(3, "\u3000", "NOUN", "x"), "FORM '\\u3000' is empty or blank"),  # named as repr() writes it
    (conllu_line(3, "a\x00b", "NOUN"), "text contains NUL characters"),
])
def test_conllu_ids_and_forms_that_are_not_words_are_refused_with_file_and_line(tmp_path, line, says):
    path = tmp_path / "x.conllu"
    path.write_text("# sent_id = a\n" + conllu_line(1, "The", "DET") + conllu_line(2, "cat", "NOUN") + line
                    + "\n", encoding="utf-8")
    with pytest.raises(ConllError) as info:
        list(read_conllu(str(path)))
    assert str(info.value).startswith(f"{path}:4: ") and says in str(info.value), info.value


def test_conllu_not_utf8_and_a_lone_cr_keep_the_file_and_line(tmp_path):
    path = tmp_path / "x.conllu"
    good = conllu_line(1, "The", "DET").encode()
    path.write_bytes(b"\xef\xbb\xbf# bom\n" + good + b"2\tc\xffat\tcat\tNOUN\t_\t_\t0\troot\t_\t_\n")
    with pytest.raises(ConllError, match=rf"^{path}:3: invalid UTF-8 at byte 3"):
        list(read_conllu(str(path)))
    # only \n ends a line, as extract reads text: a lone \r stays in its field, and later lines keep their numbers
    path.write_bytes(good + conllu_line(2, "a\rb", "X").encode() + conllu_line("x", "c", "X").encode())
    with pytest.raises(ConllError, match=rf"^{path}:3: ID 'x'"):
        list(read_conllu(str(path)))
    gz = tmp_path / "x.conllu.gz"
    gz.write_bytes(gzip.compress(b"\xef\xbb\xbf" + good + b"\n"))
    assert [s.tokens for s in read_labelled(str(gz))] == [("The",)]


def test_probe_names_the_file_and_line_that_is_not_utf8(ud, tmp_path, capsys):
    data, _, model = ud
    bad = tmp_path / "dev.conllu"
    bad.write_bytes((data / "mini-dev.conllu").read_bytes().replace(b"\tThe\t", b"\tTh\xffe\t", 1))
    line = next(k for k, text in enumerate(bad.read_bytes().split(b"\n"), 1) if b"\xff" in text)
    out = tmp_path / "out"
    assert main(["probe", "--train", str(data / "mini-train.conllu"), "--dev", str(bad), "--output", str(out),
                 "--model", model]) == 2
    assert f"error: {bad}:{line}: invalid UTF-8 at byte" in capsys.readouterr().err
    assert not out.exists()


# -- 6, 18: the sense file of similarity -------------------------------------------------------------
SENSES = "# a comment\nfruit\tApple pie is sweet .\ncompany\tApple sells phones .\n"


def test_sense_file_bom_compression_and_bad_bytes(tmp_path):
    plain = tmp_path / "plain.tsv"
    plain.write_text(SENSES, encoding="utf-8")
    expected = (["Apple pie is sweet .", "Apple sells phones ."], ["fruit", "company"])
    assert read_sense_file(str(plain))[:2] == expected
    bom = tmp_path / "bom.tsv"
    bom.write_bytes(b"\xef\xbb\xbf" + SENSES.encode())  # before a comment: still a comment
    assert read_sense_file(str(bom))[:2] == expected
    no_senses = tmp_path / "plain_bom.tsv"
    no_senses.write_bytes(b"\xef\xbb\xbfApple pie\r\nApple sells\n")
    assert read_sense_file(str(no_senses))[:2] == (["Apple pie", "Apple sells"], None)
    gz = tmp_path / "senses.tsv.gz"
    gz.write_bytes(gzip.compress(b"\xef\xbb\xbf" + SENSES.encode()))
    assert read_sense_file(str(gz))[:2] == expected
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(SENSES.encode() + b"fruit\tan \xff apple\n")
    with pytest.raises(ValueError, match=rf"^{bad}, line 4: invalid UTF-8 at byte 9"):
        read_sense_file(str(bad))
    blank = tmp_path / "blank.tsv"
    blank.write_text(SENSES + " \tApple trees grow .\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{blank}, line 4: the sense before the tab is empty or blank"):
        read_sense_file(str(blank))


def test_similarity_refuses_an_empty_sense_label(capsys, model_arg):
    assert main(["similarity", "--word", "Apple", "Apple is red", "Apple is big", "--senses", ",a", "--pretokenized",
                 "--model", model_arg]) == 2
    assert "--senses ',a': a sense label is empty or blank" in capsys.readouterr().err


def test_probe_names_a_data_folder_that_does_not_exist(tmp_path, capsys):
    assert main(["probe", str(tmp_path / "absent"), "--output", str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'absent'}: no such folder (give a folder with one *train*.conllu" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_data_folder_whose_name_holds_glob_characters_is_that_folder(tmp_path):
    """`probe 'ud[2.16]'`: the folder's name was read as a glob, so its files went unfound."""
    import argparse

    from elmo_pipeline.pipelines.probe import resolve_files

    data = tmp_path / "ud[2.16]"
    data.mkdir()
    for split in ("train", "dev"):
        (data / f"x-{split}.conllu").write_text(conllu_line(1, "Hi", "INTJ") + "\n", encoding="utf-8")
    args = argparse.Namespace(data=str(data), train=None, dev=None)
    assert resolve_files(args) == {"train": str(data / "x-train.conllu"), "dev": str(data / "x-dev.conllu")}


def test_similarity_refuses_sentences_given_twice(tmp_path, capsys, model_arg):
    tsv = tmp_path / "s.tsv"
    tsv.write_text(SENSES, encoding="utf-8")
    assert main(["similarity", "--word", "Apple", "Apple is red", "Apple is big", "--file", str(tsv),
                 "--pretokenized", "--model", model_arg]) == 2
    err = capsys.readouterr().err
    assert f"give the sentences as arguments or in --file, not both (2 given with --file {tsv})" in err


@pytest.mark.parametrize("extra, says", [
    (["--senses", "a,b,c,d"], "--file {tsv} gives a sense on each line: leave --senses out"),
    (["--pretokenized", "--lang", "de"], "--lang de chooses spaCy's tokenizer, and --pretokenized sentences are not "
                                         "tokenized: give one of them"),
])
def test_similarity_refuses_an_option_it_would_ignore(tmp_path, capsys, model_arg, extra, says):
    tsv = tmp_path / "s.tsv"
    tsv.write_text(SENSES, encoding="utf-8")
    assert main(["similarity", "--word", "Apple", "--file", str(tsv), "--model", model_arg, *extra]) == 2
    assert says.format(tsv=tsv) in capsys.readouterr().err


# -- 13: similarity's vectors and its --json ---------------------------------------------------------
def test_non_finite_vectors_are_refused_naming_the_sentence(reference_model, model_arg):
    model = BiLM.load(model_arg).eval()  # a copy of its own, to spoil
    with torch.no_grad():
        next(model.lstm.parameters()).fill_(float("nan"))
    sentences = [["the", "river", "bank"], ["the", "bank", "raised", "rates"]]
    with pytest.raises(ValueError, match=r"the vectors of 'bank' in sentence s0 \(the river bank\) are not finite"):
        similarity.word_similarity(model, sentences, "bank")
    assert similarity.word_similarity(reference_model, sentences, "bank").cosine.shape == (3, 2, 2)


def test_json_is_written_whole_or_not_at_all(tmp_path, capsys, model_arg, monkeypatch):
    out = tmp_path / "sim.json"
    args = ["similarity", "--word", "bank", "the river bank", "the bank raised rates", "--pretokenized",
            "--model", model_arg, "--json", str(out)]
    real = similarity.word_similarity

    def with_nan(*a, **k):
        result = real(*a, **k)
        result.cosine[2, 0, 1] = float("nan")
        return result

    monkeypatch.setattr(similarity, "word_similarity", with_nan)
    assert main(args) == 2
    assert "is not a finite number" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no empty file, no partial one
    monkeypatch.undo()
    assert main(args) == 0
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved["word"] == "bank" and saved["positions"] == [2, 1] and len(saved["summary"]) == 3
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main(args[:-1] + [str(folder)]) == 2
    assert f"output {folder} is an existing folder" in capsys.readouterr().err and list(folder.iterdir()) == []
    # under a file: refused before the model runs (it was an OSError once the vectors were printed)
    assert main(args[:-1] + [str(out / "sim.json")]) == 2
    said = capsys.readouterr()
    assert f"output {out / 'sim.json'} cannot be created: {out} is an existing file" in said.err and said.out == ""


def sentence_shard(folder, lengths: list[int]) -> str:
    """A sentence-layout shard in `folder` of sentences of these lengths, sentence i's vectors all i."""
    from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
    from elmo_pipeline.corpus.schema import OutputSpec, build_table

    items = []
    for i, n in enumerate(lengths):
        starts = np.arange(n, dtype=np.int64)
        layers = np.full((3, n, 8), i, np.float32)
        items.append(EmbeddedSentence(Sentence("train", i, 0, ("w",) * n, starts, starts + 1), layers, {}))
    path = folder / "sentences-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(build_table(items, OutputSpec(n_layers=3, width=8, layout="sentence", dtype="float32")), path)
    return str(path)


def test_train_batches_are_bounded_in_padded_tokens(tmp_path):
    """The train features were read in batches of --batch-sentences sentences with no token bound:
    32 sentences of 3,000 tokens made one batch of 96,000 token vectors per layer."""
    from elmo_pipeline.downstream.probe import ProbeConfig
    from elmo_pipeline.pipelines.probe import train_features

    def shard(name: str, lengths: list[int]) -> str:
        return sentence_shard(tmp_path / name, lengths)

    config = ProbeConfig()
    assert (config.batch_sentences, config.batch_tokens) == (32, 32_768)
    long = [3000 if i % 2 else 10 for i in range(64)]
    lengths = {}
    for batch in train_features([shard("long", long)], config):
        assert batch.features.shape[1] * batch.features.shape[2] <= config.batch_tokens  # 10 sentences of 3,000
        for row, s in enumerate(batch.sentence_index.tolist()):
            assert float(batch.features[0, row, 0, 0]) == s
            lengths[s] = int(batch.lengths[row])
    assert lengths == dict(enumerate(long))
    # ordinary sentences (UD EWT's longest has 159 tokens) make the batches they made before, in the same order
    ordinary = shard("ordinary", [int(n) for n in np.random.default_rng(0).integers(1, 160, 300)])
    before = ParquetFeatureDataset([ordinary], batch_sentences=32, shuffle_buffer=config.shuffle_buffer, seed=0)
    assert ([b.sentence_index.tolist() for b in train_features([ordinary], config)]
            == [b.sentence_index.tolist() for b in before])


def test_the_train_shuffle_buffer_is_bounded_in_tokens(tmp_path):
    """The train features' shuffle buffer held --shuffle-buffer (2,048) sentences whatever their
    length: 100 sentences of 3,000 tokens were all in it at once, 301,000 token vectors per layer."""
    from elmo_pipeline.downstream.probe import ProbeConfig
    from elmo_pipeline.pipelines.probe import train_features

    config = ProbeConfig()
    assert (config.shuffle_buffer, config.shuffle_tokens) == (2048, 131_072)
    long = [3000 if i % 2 else 10 for i in range(200)]
    train = train_features([sentence_shard(tmp_path / "long", long)], config)
    lengths = {}
    for batch in train:
        for row, s in enumerate(batch.sentence_index.tolist()):
            lengths[s] = n = int(batch.lengths[row])
            assert float(batch.features[0, row, 0, 0]) == float(batch.features[0, row, n - 1, 0]) == s
    assert lengths == dict(enumerate(long)) and train.stats.sentences == 200
    # the bound, and the sentence that came in over it until others leave
    assert 131_072 - 3000 < train.stats.peak_buffered_tokens <= 131_072 + 3000
    # a sentence longer than the bound waits alone, and leaves when the next comes
    lone = ParquetFeatureDataset([sentence_shard(tmp_path / "lone", [5, 3000, 5, 2500, 5])], shuffle_buffer=4,
                                 shuffle_tokens=2000, seed=1)
    assert [s for batch in lone for s in batch.sentence_index.tolist()] == [0, 1, 2, 3, 4]
    assert (lone.stats.peak_buffered_sentences, lone.stats.peak_buffered_tokens) == (1, 3000)


def test_dev_scoring_batches_are_bounded_in_padded_tokens(tmp_path):
    """The dev features were read in batches of 256 sentences with no token bound: 255 short
    sentences padded to one of 3,000 tokens took 2.2 GiB with the default model."""
    from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
    from elmo_pipeline.corpus.schema import OutputSpec, build_table
    from elmo_pipeline.pipelines.probe import SCORING_BATCH_TOKENS, scoring_features

    items = []
    for i in range(256):
        n = 3000 if i == 7 else 10
        starts = np.arange(n, dtype=np.int64)
        layers = np.full((3, n, 8), i, np.float32)
        items.append(EmbeddedSentence(Sentence("dev", i, 0, ("w",) * n, starts, starts + 1), layers, {}))
    shard = tmp_path / "sentences-00000-of-00001.parquet"
    pq.write_table(build_table(items, OutputSpec(n_layers=3, width=8, layout="sentence", dtype="float32")), shard)
    lengths = {}
    for batch in scoring_features([str(shard)]):
        assert batch.features.shape[1] * batch.features.shape[2] <= max(SCORING_BATCH_TOKENS, 3000)
        for row, s in enumerate(batch.sentence_index.tolist()):
            assert float(batch.features[0, row, 0, 0]) == s
            lengths[s] = int(batch.lengths[row])
    assert lengths == {i: 3000 if i == 7 else 10 for i in range(256)}


def test_probe_refuses_a_sentence_longer_than_max_sentence_tokens_before_any_work(tmp_path, capsys,
                                                                                   elmo_fixture_dir):
    # the extraction embeds a labelled sentence whole: one of 100,000 tokens grew past 5.5 GB and
    # failed the job in torch's allocator after 3 minutes
    def sentence(n, sent_id):
        return f"# sent_id = {sent_id}\n" + "".join(conllu_line(k, f"w{k}", "NOUN" if k % 2 else "VERB")
                                                     for k in range(1, n + 1)) + "\n"

    train, dev = tmp_path / "t.conllu", tmp_path / "d.conllu"
    train.write_text(sentence(3, "short") + sentence(7, "long-one"), encoding="utf-8")
    dev.write_text(sentence(2, "dev-1"), encoding="utf-8")
    out = tmp_path / "out"
    model = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    assert main(["probe", "--train", str(train), "--dev", str(dev), "--output", str(out), "--model", model,
                 "--max-sentence-tokens", "6"]) == 2
    assert (f"train file {train}, sentence 2 (sent_id long-one): 7 tokens, more than --max-sentence-tokens 6"
            in capsys.readouterr().err)
    assert not out.exists()
    sentences = {"train": list(read_conllu(str(train))), "dev": list(read_conllu(str(dev)))}
    assert [len(s.tokens) for s in sentences["train"]] == [3, 7]
    check_lengths(sentences, {"train": str(train), "dev": str(dev)}, 7)  # within the bound: no error
