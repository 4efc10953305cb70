"""The third audit of the command line, its training part: `evaluate --data` and `pretrain
--valid` read text as every other reader does (compressed by extension, without a BOM), options
that the other options make the run ignore are refused before anything is written, and `prepare`
says when it wrote no sentence."""

import bz2
import codecs
import gzip
import json
import lzma
import math
import re
import shutil
from pathlib import Path

import pytest
import zstandard

from elmo_pipeline.cli.training import main
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences, whitespace_text_sentences
from elmo_pipeline.training.initial_model import resolve_softmax
from elmo_pipeline.training.metrics_log import CSV_FIELDS
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.shards import PreparedCorpus
from elmo_pipeline.training.trainer import train
from support import HttpServer, damaged_gzip, data_path, strict_json

TINY = ["--preset", "tiny", "--batch-tokens", "300", "--threads", "1", "--log-every", "1"]
COMPRESSORS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
               ".zst": lambda data: zstandard.ZstdCompressor().compress(data)}


def _lines(count: int, skip: int = 0) -> list[str]:
    with open(data_path("wikitext2", "wiki.valid.tokens"), encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    return lines[skip:skip + count]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A prepared corpus (sentences cut at 40 tokens), a held-out text file and a model with a softmax."""
    root = tmp_path_factory.mktemp("audit3")
    doc = Document("sample", "".join(_lines(40)), "sample", 1)
    prepare_in_process(whitespace_sentences(doc, 40), str(root / "data"), tokenizer="whitespace", lang="en",
                       max_sentence_tokens=40, unk_alias="<unk>", shard_tokens=10**6)
    (root / "valid.txt").write_text("".join(_lines(6, skip=40)), encoding="utf-8")
    assert main(["pretrain", "--data", str(root / "data"), "--output", str(root / "run"), *TINY,
                 "--max-steps", "2"]) == 0
    return root


def _evaluate(capsys, model: Path, data: Path, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["evaluate", "--model", str(model), "--data", str(data), "--threads", "1", *extra]) == 0
    return strict_json(capsys.readouterr().out)


# -- 10: evaluate --data and pretrain --valid read compressed text, and drop a BOM ---------------------------------
def test_evaluate_reads_compressed_text_and_drops_a_bom_as_prepare_does(trained, tmp_path, capsys):
    plain = trained / "valid.txt"
    model = trained / "run" / "model"
    expected = _evaluate(capsys, model, plain)
    assert expected["tokens"] == sum(len(line.split()) for line in _lines(6, skip=40))
    files = {ext: tmp_path / f"valid.txt{ext}" for ext in COMPRESSORS}
    for ext, path in files.items():
        path.write_bytes(COMPRESSORS[ext](plain.read_bytes()))
    files["bom"] = tmp_path / "bom.txt"
    files["bom"].write_bytes(codecs.BOM_UTF8 + plain.read_bytes())
    for name, path in files.items():
        got = _evaluate(capsys, model, path)
        for key in ("sentences", "tokens", "forward_perplexity", "backward_perplexity", "average_perplexity"):
            assert got[key] == expected[key], (name, key)  # before: .gz "not UTF-8", a BOM one token more


def test_the_bom_is_not_glued_to_the_first_word_and_lines_are_cut_as_prepare_cuts_them(tmp_path):
    text = "first line here\nsecond\x0cpage break\nthird\u2028line\n"
    path = tmp_path / "t.txt"
    path.write_bytes(codecs.BOM_UTF8 + text.encode("utf-8"))
    sentences = list(whitespace_text_sentences(str(path)))
    # only "\n" ends a line, as extract and embed-file read it: a form feed or U+2028 is whitespace
    assert sentences == [["first", "line", "here"], ["second", "page", "break"], ["third", "line"]]
    prepared = whitespace_sentences(Document("d", text, "t", 1))
    assert sentences == [list(s.tokens) for s in prepared]
    for s in prepared:
        assert [text[a:b] for a, b in zip(s.char_starts, s.char_ends)] == list(s.tokens)


def test_a_bom_inside_a_concatenation_is_dropped_as_prepare_drops_it(tmp_path):
    path = tmp_path / "joined.txt"  # `cat a.txt b.txt` of two files saved "UTF-8 with BOM"
    path.write_bytes(codecs.BOM_UTF8 + b"first file\n" + codecs.BOM_UTF8 + b"second file\n")
    assert list(whitespace_text_sentences(str(path))) == [["first", "file"], ["second", "file"]]


@pytest.mark.parametrize("content", ["a line\nnul\x00here\n".encode(), "The cat sat .\n".encode("utf-16-le")])
def test_a_line_holding_nul_is_refused_as_prepare_sets_it_aside(tmp_path, content):
    """A UTF-16 file read as UTF-8 is NULs between letters: evaluate gave it a perplexity."""
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    number = 2 if content.startswith(b"a line") else 1
    with pytest.raises(ValueError, match=re.escape(f"{path}: line {number} holds NUL characters (a binary or "
                                                   "UTF-16 file?)")):
        list(whitespace_text_sentences(str(path)))


def test_a_utf16_held_out_file_is_named_by_its_byte_order_mark_as_prepare_names_it(tmp_path):
    # 'line 1 is not UTF-8 (invalid start byte at byte 0)' where extract's and prepare's record names the mark
    path = tmp_path / "t.txt"
    path.write_bytes("The cat sat .\n".encode("utf-16"))  # Notepad's "Unicode": a BOM, then UTF-16LE
    with pytest.raises(ValueError, match=re.escape(f"{path}: line 1 is not UTF-8 (a UTF-16 byte-order mark (the file "
                                                   "is UTF-16: convert it to UTF-8) at byte 0)")):
        list(whitespace_text_sentences(str(path)))


def test_a_damaged_gzip_held_out_file_names_zlibs_error_by_its_module(tmp_path):
    # it said 'cannot read it (error: Error -3 while decompressing data: ...)', as extract's records did
    path = tmp_path / "t.txt.gz"
    path.write_bytes(damaged_gzip(b"Compressed line one.\nCompressed line two.\n" * 50))
    with pytest.raises(ValueError, match=re.escape(f"{path}: cannot read it (zlib.error: Error -3 while decompressing")):
        list(whitespace_text_sentences(str(path)))


def test_evaluate_names_the_default_model_as_every_other_output_does(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat .\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["evaluate", "--data", str(text), "--threads", "1"]) == 0
    result = strict_json(capsys.readouterr().out)
    assert result["model"] == "embedded default" and result["tokens"] == 7  # it was "default" here alone


def test_held_out_files_are_found_as_every_command_finds_its_input(tmp_path):
    """A name with glob characters or a comma is that file (the old reader split at commas and
    globbed it, finding nothing), and a folder is named as one."""
    for name in ("held[1].txt", "a,b.txt"):
        (tmp_path / name).write_text("one two\nthree\n", encoding="utf-8")
        assert list(whitespace_text_sentences(str(tmp_path / name))) == [["one", "two"], ["three"]]
    assert len(list(whitespace_text_sentences(str(tmp_path / "*.txt")))) == 4
    with pytest.raises(ValueError, match=re.escape(f"input pattern {str(tmp_path)!r} is a folder")):
        list(whitespace_text_sentences(str(tmp_path)))


def test_invalid_utf8_in_a_compressed_file_is_named_with_its_line(trained, tmp_path, capsys):
    bad = tmp_path / "bad.txt.gz"
    bad.write_bytes(gzip.compress(b"a fine line\nbad \xff byte\n"))
    assert main(["evaluate", "--model", str(trained / "run" / "model"), "--data", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: line 2 is not UTF-8 (invalid start byte at byte 4)" in err and "Traceback" not in err
    fake = tmp_path / "fake.txt.gz"
    fake.write_bytes(b"not gzip at all\n")
    assert main(["evaluate", "--model", str(trained / "run" / "model"), "--data", str(fake)]) == 2
    err = capsys.readouterr().err
    assert f"{fake}: cannot read it (BadGzipFile: Not a gzipped file" in err and "Traceback" not in err


def test_pretrain_validates_on_compressed_text(trained, tmp_path, capsys):
    valid = tmp_path / "valid.txt.xz"
    valid.write_bytes(lzma.compress(codecs.BOM_UTF8 + (trained / "valid.txt").read_bytes()))
    run = tmp_path / "run"
    assert main(["pretrain", "--data", str(trained / "data"), "--output", str(run), *TINY, "--max-steps", "1",
                 "--valid", str(valid)]) == 0
    best = strict_json((run / "best" / "valid.json").read_text(encoding="utf-8"))
    assert best["tokens"] == sum(len(line.split()) for line in _lines(6, skip=40))


def test_max_steps_0_validates_the_starting_model(trained, tmp_path, capsys):
    """With `--max-steps 0` the loop takes no step, so the end of the run validates what it
    publishes: the model it started from (it was left unvalidated, best/ absent, in silence)."""
    run = tmp_path / "run"
    valid = trained / "valid.txt"
    assert main(["pretrain", "--data", str(trained / "data"), "--output", str(run), *TINY[2:], "--max-steps", "0",
                 "--init", str(trained / "run" / "model"), "--no-grow-vocab", "--valid", str(valid)]) == 0
    result = strict_json(capsys.readouterr().out)
    expected = _evaluate(capsys, run / "model", valid)
    assert result["best_step"] == 0
    assert result["best_valid"] == pytest.approx(expected["average_perplexity"], rel=1e-9)
    best = strict_json((run / "best" / "valid.json").read_text(encoding="utf-8"))
    assert best["step"] == 0 and best["tokens"] == expected["tokens"]
    rows = (run / "metrics.csv").read_text(encoding="utf-8").splitlines()
    assert [row.split(",")[:2] for row in rows[1:]] == [["valid", "0"]]

def test_sampled_softmax_with_a_sample_per_word_or_more_is_logged_as_the_full_softmax(trained, tmp_path, capsys):
    """`--n-samples` no fewer than the words leaves no word out: training computes the full
    softmax, so its rows are losses with perplexities (they were said to be sampled, without)."""
    vocab = len(PreparedCorpus(str(trained / "data")).vocab)
    runs = {}
    for softmax in (["--softmax", "sampled", "--n-samples", str(vocab)], ["--softmax", "full"]):
        run = tmp_path / softmax[1]
        assert main(["pretrain", "--data", str(trained / "data"), "--output", str(run), *TINY, "--max-steps", "2",
                     "--dropout", "0", *softmax]) == 0
        runs[softmax[1]] = capsys.readouterr().err, (run / "metrics.csv").read_text(encoding="utf-8").splitlines()
    err, rows = runs["sampled"]
    assert f"softmax sampled ({vocab:,} samples, no fewer than the words: trained on the full softmax)" in err
    assert "sampled loss" not in err and "| perplexity " in err
    # the same losses and perplexities as the full softmax's run, step by step
    assert [r.split(",")[6:10] for r in rows] == [r.split(",")[6:10] for r in runs["full"][1]]
    train = [r.split(",") for r in rows[1:]]
    assert [r[:2] for r in train] == [["train", "1"], ["train", "2"]]
    for r in train:
        assert float(r[7]) == pytest.approx(math.exp(float(r[6])), rel=1e-4)


# -- 15: evaluate --max-sentence-tokens on a prepared folder -------------------------------------------------------
def test_evaluate_cuts_a_prepared_folder_again_up_to_the_windows_prepare_made(trained, capsys):
    data, model = trained / "data", trained / "run" / "model"
    corpus = PreparedCorpus(str(data))
    lengths = [len(tokens) for shard in range(corpus.n_shards) for tokens in corpus.read_shard(shard)[0]]
    whole = _evaluate(capsys, model, data)
    assert whole["sentences"] == len(lengths) and whole["tokens"] == sum(lengths)
    cut = _evaluate(capsys, model, data, "--max-sentence-tokens", "3")
    assert cut["sentences"] == sum(math.ceil(n / 3) for n in lengths) > whole["sentences"]  # before: as whole
    assert cut["tokens"] == whole["tokens"] and cut["average_perplexity"] != whole["average_perplexity"]
    same = _evaluate(capsys, model, data, "--max-sentence-tokens", "40")
    assert same["sentences"] == whole["sentences"] and same["average_perplexity"] == whole["average_perplexity"]
    # more than prepare's 40 cannot be done: refused, before the model is looked for
    assert main(["evaluate", "--model", str(trained / "missing"), "--data", str(data),
                 "--max-sentence-tokens", "41"]) == 2
    err = capsys.readouterr().err
    assert (f"--max-sentence-tokens 41: {data} is a prepared folder whose sentences prepare already cut into "
            "windows of at most 40 tokens") in err and "missing" not in err


def test_evaluate_refuses_max_document_mb_for_a_prepared_folder_whose_lines_prepare_read(trained, capsys, tmp_path):
    data, model = trained / "data", trained / "run" / "model"
    # before: accepted and ignored (prepare read the lines); refused before the model is looked for
    assert main(["evaluate", "--model", str(trained / "missing"), "--data", str(data),
                 "--max-document-mb", "0.5"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith(f"--max-document-mb 0.5: {data} is a prepared folder, whose lines prepare read under its "
                        "own --max-document-mb; the option bounds the lines of text only"), err
    # text takes it; without it, text is read under the default bound
    text = tmp_path / "long.txt"
    text.write_bytes(b"a b\n" + b"x" * (2**19 + 1) + b"\n")
    assert main(["evaluate", "--model", str(model), "--data", str(text), "--max-document-mb", "0.5"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"{text}, line 2: line of more than 0.5 MiB (--max-document-mb 0.5): not read")
    assert _evaluate(capsys, model, text)["sentences"] == 2


# -- 15: pretrain options that the other options make the run ignore -----------------------------------------------
@pytest.mark.parametrize("extra, says", [
    (["--eval-every", "1"], "--eval-every 1 sets how often --valid is evaluated, and no --valid is given"),
    (["--eval-batch-tokens", "100"], "--eval-batch-tokens 100 sets the batches --valid is evaluated in, and no "
                                     "--valid is given"),
    (["--softmax", "full", "--n-samples", "5"],
     "--n-samples 5 is read by the sampled softmax only, and this run's softmax is full"),
    (["--n-samples", "5"], "--n-samples 5 is read by the sampled softmax only, and this run's softmax is full"),
    (["--softmax", "full", "--cutoffs", "100,1000"],
     "--cutoffs 100,1000 is read by the adaptive softmax only, and this run's softmax is full"),
    (["--softmax", "sampled", "--cutoffs", "100,1000"],
     "--cutoffs 100,1000 is read by the adaptive softmax only, and this run's softmax is sampled"),
    (["--no-grow-vocab"], "--no-grow-vocab keeps the vocabulary of the --init model, and no --init is given"),
    (["--optimizer", "adam", "--adagrad-init", "5"],
     "--adagrad-init 5.0 is Adagrad's initial accumulator, and --optimizer adam has none"),
    (["--min-lr-ratio", "0.5"], "--min-lr-ratio 0.5 is where a linear or cosine schedule ends, and --schedule "
                                "constant keeps the learning rate"),
    (["--model-config", "spec.json"], "--preset tiny and --model-config spec.json both give the model's shape"),
])
def test_an_option_the_run_would_ignore_is_refused_before_the_run_folder_exists(trained, tmp_path, capsys, extra,
                                                                                says):
    run = tmp_path / "run"
    extra = [str(tmp_path / a) if a == "spec.json" else a for a in extra]
    assert main(["pretrain", "--data", str(trained / "data"), "--output", str(run), *TINY, "--max-steps", "1",
                 *extra]) == 2
    assert says.replace("spec.json", str(tmp_path / "spec.json")) in capsys.readouterr().err
    assert not run.exists()


def test_a_run_that_ends_within_its_warm_up_is_warned_of_not_refused(trained, tmp_path, capsys):
    """A decay starts after the warm-up: a run that ends first never decays. 5a63448 and 20d51e8
    refused it, which stopped the smoke test of a recipe (2 steps of one with a 4-step warm-up) and
    a run cut to a deadline (benchmarks/gpu_train_default.py): it runs, warned of, with the rates
    the schedule gives."""
    LR = 0.002
    common = ["pretrain", "--data", str(trained / "data"), *TINY, "--schedule", "cosine", "--lr", str(LR)]
    assert main([*common, "--output", str(tmp_path / "a"), "--warmup-steps", "4", "--max-steps", "2"]) == 0
    assert ("warning: --schedule cosine decays the learning rate after --warmup-steps 4, and the run ends at step 2 "
            "(--max-steps): it never decays, its last step at 0.5 x --lr") in capsys.readouterr().err
    train = [r.split(",") for r in (tmp_path / "a" / "metrics.csv").read_text().splitlines() if r.startswith("train,")]
    assert [int(r[1]) for r in train] == [1, 2]
    lr = CSV_FIELDS.index("lr")
    assert [float(r[lr]) for r in train] == pytest.approx([LR / 4, LR / 2])
    # without --max-steps the data ends it: the steps --epochs gives, counted in the shards
    assert main([*common, "--output", str(tmp_path / "b"), "--warmup-steps", "1000"]) == 0
    captured = capsys.readouterr()
    steps = strict_json(captured.out)["step"]
    assert 1 < steps < 1000
    assert (f"the run ends at step {steps} (--epochs 1 on {trained / 'data'}): it never decays, its last step at "
            f"{steps / 1000:.3g} x --lr") in captured.err
    # a warm-up shorter than the run: no warning
    assert main([*common, "--output", str(tmp_path / "c"), "--warmup-steps", "1", "--max-steps", "2"]) == 0
    assert "never decays" not in capsys.readouterr().err


def _damage_the_shard(folder: Path) -> Path:
    """The prepared corpus `folder` with its one shard no Parquet: a run that reads it says so."""
    (shard,) = folder.glob("shard-*.parquet")
    shard.write_bytes(b"not a parquet file")
    return folder


@pytest.mark.parametrize("model", [["--model-config", "spec.json"], ["--init", "missing-model"]])
def test_a_bad_model_is_named_before_the_decay_counts_the_steps_in_the_shards(trained, tmp_path, capsys, model):
    """Counting a decay's steps reads every shard (minutes on a large corpus); 20d51e8 did it before
    the model was built, so a --model-config that is no JSON object or a missing --init was named
    only after that pass (here, a damaged shard was named instead)."""
    (tmp_path / "spec.json").write_text("[1]", encoding="utf-8")
    model = [str(tmp_path / a) if a in ("spec.json", "missing-model") else a for a in model]
    shutil.copytree(trained / "data", tmp_path / "data")
    assert main(["pretrain", "--data", str(_damage_the_shard(tmp_path / "data")), "--output",
                 str(tmp_path / "run"), "--batch-tokens", "300", "--threads", "1", "--schedule", "cosine",
                 *model]) == 2
    err = capsys.readouterr().err
    assert model[1] in err and "not a readable training shard" not in err, err
    assert not (tmp_path / "run").exists()


def test_the_rerun_of_a_finished_decaying_run_reads_no_shard_and_has_nothing_to_do(trained, tmp_path, capsys):
    """A finished run's rerun has nothing to do (83a31d1 read no shard for it); 20d51e8 counted the
    steps in every shard first, and refused a warm-up that the run had already gone through."""
    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(trained / "data", data)
    common = ["pretrain", "--data", str(data), "--output", str(run), *TINY, "--schedule", "cosine"]
    assert main(common) == 0
    steps = strict_json(capsys.readouterr().out)["step"]
    _damage_the_shard(data)
    for extra in ([], ["--warmup-steps", str(steps)]):
        assert main([*common, *extra]) == 0
        captured = capsys.readouterr()
        assert "this run has already finished; nothing to do" in captured.err, captured.err
        assert strict_json(captured.out)["step"] == steps


def test_no_grow_vocab_with_original_weights_which_have_no_vocabulary_is_refused(trained, elmo_fixture_dir, tmp_path,
                                                                                 capsys):
    run = tmp_path / "run"
    init = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    assert main(["pretrain", "--data", str(trained / "data"), "--output", str(run), "--init", init, "--no-grow-vocab",
                 "--max-steps", "1", "--threads", "1", "--batch-tokens", "300"]) == 2
    assert (f"--no-grow-vocab keeps the vocabulary of the --init model, and {init} has none (its vocabulary is the "
            "corpus's): leave it out") in capsys.readouterr().err
    assert not run.exists()


@pytest.mark.parametrize("extra, says", [
    (["--preset", "small"], "--preset small shapes a new model, and --init {model} gives the model"),
    (["--preset", "tiny"], "--preset tiny shapes a new model"),  # the library's default, given on the command line
    (["--model-config", "missing.json"], "--model-config missing.json shapes a new model, and --init {model} gives"),
])
def test_a_shape_given_with_init_is_refused(trained, tmp_path, capsys, extra, says):
    model = trained / "run" / "model"
    run = tmp_path / "run"
    assert main(["pretrain", "--data", str(trained / "data"), "--output", str(run), "--init", str(model),
                 "--max-steps", "1", "--threads", "1", *extra]) == 2
    assert says.format(model=model) in capsys.readouterr().err
    assert not run.exists()


def test_the_same_options_where_the_run_reads_them_are_accepted(trained, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["pretrain", "--data", str(trained / "data"), "--output", str(run), *TINY, "--max-steps", "2",
                 "--valid", str(trained / "valid.txt"), "--eval-every", "1", "--schedule", "cosine",
                 "--min-lr-ratio", "0.5", "--adagrad-init", "2", "--softmax", "sampled", "--n-samples", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    recorded = strict_json((run / "run.json").read_text(encoding="utf-8"))
    assert (recorded["eval_every"], recorded["min_lr_ratio"], recorded["adagrad_init"]) == (1, 0.5, 2.0)
    valid_rows = [r for r in (run / "metrics.csv").read_text().splitlines() if r.startswith("valid,")]
    assert [r.split(",")[1] for r in valid_rows] == ["1", "2"]
    tuned = tmp_path / "tuned"
    assert main(["pretrain", "--data", str(trained / "data"), "--output", str(tuned), "--init",
                 str(run / "model"), "--no-grow-vocab", "--max-steps", "1", "--threads", "1",
                 "--batch-tokens", "300"]) == 0
    # a softmax the preset or the config makes sampled reads --n-samples without --softmax
    assert resolve_softmax({"kind": "sampled", "n_samples": 8192}, 100, n_samples=5)["n_samples"] == 5
    assert resolve_softmax({"kind": "adaptive"}, 100, cutoffs=[10, 50])["cutoffs"] == [10, 50]
    # cutoffs given for this run are kept or refused, never dropped (a preset's are fitted to the vocabulary)
    for given in ([10, 5000], [99]):
        with pytest.raises(ValueError, match=re.escape(f"--cutoffs {','.join(map(str, given))}: {given[-1]} is past "
                                                       "this run's vocabulary of 100 words (each cutoff must be below 99)")):
            resolve_softmax({"kind": "adaptive"}, 100, cutoffs=given)
    assert resolve_softmax({"kind": "adaptive", "cutoffs": [10, 5000]}, 100)["cutoffs"] == [10]


def test_the_library_refuses_what_it_would_ignore_by_the_values_it_was_given(trained, tmp_path):
    from elmo_pipeline.training.options import given_options

    args = TrainArgs(data=str(trained / "data"), output=str(tmp_path / "run"), max_steps=1, optimizer="adam",
                     adagrad_init=5.0)
    with pytest.raises(ValueError, match="--adagrad-init 5.0 is Adagrad's initial accumulator"):
        train(args)
    assert not (tmp_path / "run").exists()
    # TrainArgs's own defaults are not given: --init with the default preset is no conflict
    assert "preset" not in given_options(TrainArgs(data="d", output="o", init="m"))
    assert given_options(TrainArgs(data="d", output="o", init="m", preset="small")) >= {"preset", "init"}


# -- 14 and 20: prepare -------------------------------------------------------------------------------------------
@pytest.fixture
def prepared(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("the <unk> cat sat\nUNK words UNK here\n", encoding="utf-8")
    out = tmp_path / "prepared"
    assert main(["prepare", "--input", str(src), "--output", str(out), "--tokenizer", "whitespace"]) == 0
    return src, out


@pytest.mark.parametrize("extra, says", [
    (["--tokenizer", "whitespace", "--lang", "qq"], "--lang qq is spaCy's, and --tokenizer whitespace splits lines"),
    (["--tokenizer", "whitespace", "--spacy-model", "no_such_pipeline"],
     "--spacy-model no_such_pipeline is spaCy's, and --tokenizer whitespace splits lines"),
    (["--tokenizer", "whitespace", "--doc-per", "file"],
     "--doc-per file changes no sentence with --tokenizer whitespace"),
    (["--tokenizer", "whitespace", "--unk-token", "<unk> x"],
     "--unk-token '<unk> x' is empty or holds whitespace, and --tokenizer whitespace cuts tokens at whitespace"),
    (["--unk-token", "<unk>"],
     "--unk-token '<unk>': spaCy (--lang en) tokenizes it as ['<', 'unk', '>'], not as one token"),
])
def test_prepare_refuses_what_its_tokenizer_would_ignore_before_clearing(prepared, capsys, extra, says):
    src, out = prepared
    before = _snapshot(out)
    capsys.readouterr()
    assert main(["prepare", "--input", str(src), "--output", str(out), "--overwrite", *extra]) == 2
    assert says in capsys.readouterr().err
    assert _snapshot(out) == before


def test_prepare_takes_the_defaults_given_and_an_unk_token_spacy_keeps_whole(prepared, capsys):
    src, out = prepared
    assert main(["prepare", "--input", str(src), "--output", str(out), "--overwrite", "--tokenizer",
                 "whitespace", "--lang", "en", "--doc-per", "line", "--unk-token", "<unk>"]) == 0
    assert PreparedCorpus(str(out)).vocab.counts[2] == 1  # <unk> became <UNK>
    assert main(["prepare", "--input", str(src), "--output", str(out), "--overwrite", "--unk-token", "UNK"]) == 0
    vocab = PreparedCorpus(str(out)).vocab
    assert vocab.counts[2] == 2 and "UNK" not in vocab.tokens and "<" in vocab.tokens


def test_prepare_that_writes_no_sentence_exits_1_saying_why(tmp_path, capsys):
    binary = tmp_path / "bin.dat"
    binary.write_bytes(b"\xff\xfe bad\n\x80 worse\n")
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["prepare", "--input", str(binary), "--output", str(out), "--tokenizer", "whitespace"]) == 1
    captured = capsys.readouterr()
    summary = strict_json(captured.out)
    assert (summary["sentences"], summary["tokens"], summary["errors"]) == (0, 0, 2)
    assert (f"elmo-pipeline prepare: no sentence was written: 2 records were rejected ({out}/errors.jsonl says "
            "why)") in captured.err
    lines = (out / "errors.jsonl").read_text(encoding="utf-8").splitlines()
    assert [list(strict_json(line)) for line in lines] == [["doc_id", "line", "reason", "source", "stage"]] * 2
    assert [strict_json(line)["line"] for line in lines] == [1, 2]  # the keys in extract's order, sorted
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\n", encoding="utf-8")
    assert main(["prepare", "--input", str(blank), "--output", str(tmp_path / "out2"), "--tokenizer",
                 "whitespace"]) == 1
    assert "no sentence was written: the input holds no text" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_cutoffs_list_is_refused_by_the_parser(tmp_path, capsys, value):
    # `--cutoffs "$CUTOFFS"` with the variable unset: the empty list was taken for none given, and
    # the run trained an adaptive softmax with cutoffs of its own choosing
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(["pretrain", "--data", str(tmp_path / "data"), "--output", str(run), "--softmax", "adaptive",
              "--cutoffs", value])
    assert exited.value.code == 2
    assert f"argument --cutoffs: expected comma-separated integers, got {value!r}" in capsys.readouterr().err
    assert not run.exists()


def test_an_empty_valid_is_refused_not_taken_for_none(tmp_path, capsys):
    # `--valid "$VALID"` with the variable unset: the run went on without a validation, exit 0
    run = tmp_path / "run"
    assert main(["pretrain", "--data", str(tmp_path / "data"), "--output", str(run), "--valid", ""]) == 2
    assert "--valid '' names no data; give a prepared folder or a text glob" in capsys.readouterr().err
    assert not run.exists()


@pytest.mark.parametrize("option, says", [
    # "--preset tiny shapes a new model, and --init  gives the model" (the default preset's own refusal)
    ("--init", "--init '' names no model; give a model folder or URL"),
    # "give a preset, a model config or an init model", where --model-config was given
    ("--model-config", "--model-config '' names no file; give a JSON file"),
    ("--preset", "--preset '' names no preset; give its name"),
    # " is not a prepared folder (it has no manifest.json)", naming nothing
    ("--data", "--data '' names no data; give the folder `prepare` wrote"),
])
def test_an_empty_model_or_data_option_is_refused_by_name(trained, tmp_path, capsys, option, says):
    run = tmp_path / "run"
    command = {"--data": str(trained / "data"), "--output": str(run), option: ""}
    assert main(["pretrain", *(part for item in command.items() for part in item)]) == 2
    assert says in capsys.readouterr().err
    assert not run.exists()


# -- export, evaluate --model: a run folder given where a model is expected --------------------------------------
def test_a_run_folder_given_as_a_model_names_the_models_it_holds(trained, tmp_path, capsys):
    # "RUN/config.json: file not found" said nothing of model/, best/ or the checkpoints
    run = trained / "run"
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["step-000000002"] and (run / "model" / "config.json").is_file()
    latest = checkpoints[-1]
    capsys.readouterr()
    assert main(["export", str(run), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"elmo-pipeline export: error: {run} is a pretrain run folder, not a model folder; give {run / 'model'} "
        f"(its final model), or a checkpoint, such as {latest} (the latest)\n")
    assert main(["evaluate", "--model", str(run / "checkpoints"), "--data", str(trained / "valid.txt")]) == 2
    assert capsys.readouterr().err == (
        f"elmo-pipeline evaluate: error: {run / 'checkpoints'} is the checkpoints folder of a pretrain run, not a "
        f"model folder; give one checkpoint, such as {latest} (the latest)\n")
    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints").mkdir(parents=True)
    (unfinished / "run.json").write_bytes((run / "run.json").read_bytes())
    assert main(["export", str(unfinished), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"elmo-pipeline export: error: {unfinished} is a pretrain run folder, not a model folder (its final model, "
        f"{unfinished / 'model'}, is written when the run ends); it holds no model yet\n")
    assert not (tmp_path / "out").exists()
    # the checkpoint named is one: it exports
    assert main(["export", str(latest), "--output", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


def test_an_init_model_url_is_recorded_without_its_password_or_token(trained, tmp_path, capsys):
    """run.json and the log held --init as given: http://user:pw@host/m/?token=t wrote the password
    and the token into the run folder. They are left out, as extract's metadata leaves them out, so
    a resume with a renewed token is the same --init (and a run.json that holds one resumes too)."""
    server = HttpServer(trained)
    try:
        given = server.url.replace("://", "://user:pw-7Hq@", 1) + "/ok/run/model/?token="
        run = tmp_path / "run"
        command = ["pretrain", "--data", str(trained / "data"), "--output", str(run), *TINY[2:]]
        assert main([*command, "--max-steps", "1", "--init", given + "tok-9Zx"]) == 0
        assert strict_json((run / "run.json").read_text(encoding="utf-8"))["init"] == f"{server.url}/ok/run/model/"
        written = (run / "run.json").read_text(encoding="utf-8") + "".join(capsys.readouterr())
        assert f"init from {server.url}/ok/run/model/: vocabulary" in written
        assert [secret for secret in ("user:", "pw-7Hq", "tok-9Zx") if secret in written] == []
        assert main([*command, "--max-steps", "2", "--init", given + "tok-renewed"]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 2
        recorded = strict_json((run / "run.json").read_text(encoding="utf-8"))
        (run / "run.json").write_text(json.dumps({**recorded, "init": given + "tok-9Zx"}), encoding="utf-8")
        assert main([*command, "--max-steps", "3", "--init", given + "tok-renewed"]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 3
    finally:
        server.close()


def test_data_and_valid_urls_are_recorded_without_their_password(trained, tmp_path, capsys):
    """run.json, trainer_state.json, best/valid.json and evaluate's JSON held --data and --valid as
    given: http://user:pw@host/valid.txt wrote the password into the run folder. They hold the URL
    without it, and a resume whose --valid has another password is on the same data (best/ is not
    judged again)."""
    server = HttpServer(trained)
    try:
        given = server.url.replace("://", "://user:pw-7Hq@", 1) + "/ok/"
        run = tmp_path / "run"
        command = ["pretrain", "--data", given + "data/", "--output", str(run), *TINY, "--valid"]
        assert main([*command, given + "valid.txt", "--max-steps", "1", "--checkpoint-every", "1"]) == 0
        shown = f"{server.url}/ok/"
        assert {k: strict_json((run / "run.json").read_text(encoding="utf-8"))[k] for k in ("data", "valid")} == {
            "data": shown + "data/", "valid": shown + "valid.txt"}
        assert strict_json((run / "best" / "valid.json").read_text(encoding="utf-8"))["data"] == shown + "valid.txt"
        [state] = run.glob("checkpoints/*/trainer_state.json")
        assert strict_json(state.read_text(encoding="utf-8"))["best_data"] == shown + "valid.txt"
        capsys.readouterr()
        assert main(["evaluate", "--model", str(run / "model"), "--data", given + "valid.txt", "--threads", "1"]) == 0
        assert strict_json(capsys.readouterr().out)["data"] == shown + "valid.txt"
        renewed = server.url.replace("://", "://user:pw-renewed@", 1) + "/ok/valid.txt"
        assert main([*command, renewed, "--max-steps", "2"]) == 0
        assert "was judged on --valid" not in capsys.readouterr().err  # the same data: best/ stands
        written = b"".join(p.read_bytes() for p in run.rglob("*") if p.is_file())
        assert [secret for secret in (b"user:", b"pw-7Hq", b"pw-renewed") if secret in written] == []
        # export's JSON names its sources as every output names a model
        assert main(["export", given + "run/model/?token=tok-9Zx", "--output", str(tmp_path / "exported")]) == 0
        assert strict_json(capsys.readouterr().out)["sources"] == [shown + "run/model/"]
    finally:
        server.close()


def test_a_signed_url_of_text_or_of_a_prepared_folder_is_read_as_such(trained, capsys):
    """is_prepared joined manifest.json after an HTTP URL's query (`valid.txt?token=t/manifest.json`),
    which the server answered with valid.txt: evaluate --data and pretrain --valid took the text for a
    prepared folder, 'does not exist'; a prepared folder's shards were looked for so too, 'missing'.
    The query goes after the name, as every file of a folder is read."""
    server = HttpServer(trained)
    try:
        model = trained / "run" / "model"
        for name in ("valid.txt", "data"):
            local = _evaluate(capsys, model, trained / name)
            signed = _evaluate(capsys, model, f"{server.url}/ok/{name}{'/' if name == 'data' else ''}?token=t")
            assert signed["average_perplexity"] == local["average_perplexity"] and signed["tokens"] == local["tokens"]
        asked = {path for _, path in server.requests}
        assert {"/ok/data/manifest.json?token=t", "/ok/data/vocab.json?token=t"} <= asked
    finally:
        server.close()


def test_a_run_json_that_holds_the_password_of_data_and_valid_resumes_on_the_same_urls(trained, tmp_path, capsys):
    """Versions before 3bcc58b wrote --data and --valid into run.json as given, password and all; a
    resume with the very same URLs was told 'arguments differ from the run's first command: data,
    max_steps, valid', as if other data. run.json is read in today's terms, as its `init` is."""
    server = HttpServer(trained)
    try:
        given = server.url.replace("://", "://user:pw-7Hq@", 1) + "/ok/"
        run = tmp_path / "run"
        command = ["pretrain", "--data", given + "data/", "--valid", given + "valid.txt", "--output", str(run), *TINY,
                   "--checkpoint-every", "1"]
        assert main([*command, "--max-steps", "1"]) == 0
        recorded = strict_json((run / "run.json").read_text(encoding="utf-8"))
        # what such a version left: the URLs as given
        (run / "run.json").write_text(json.dumps({**recorded, "data": given + "data/", "valid": given + "valid.txt"}),
                                      encoding="utf-8")
        capsys.readouterr()
        assert main([*command, "--max-steps", "2"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["step"] == 2
        notes = [line for line in err.splitlines() if line.startswith("note: ")]
        assert notes == ["note: arguments differ from the run's first command: max_steps"]
    finally:
        server.close()


def test_text_in_an_archive_is_read_as_text_by_evaluate_and_pretrain_valid(trained, tmp_path, capsys):
    """c6a115f joined manifest.json to the whole URL to ask whether it named a prepared folder, and a
    chain's last part is its archive: evaluate --data zip://valid.txt::v.zip (and pretrain --valid)
    stopped, "[Errno 20] Not a directory: '.../v.zip/manifest.json'", where 83a31d1 read the text.
    The name is joined to the path inside the file system, as before c6a115f."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "v.zip", "w") as archive:
        archive.write(trained / "valid.txt", "valid.txt")
    in_archive = f"zip://valid.txt::{tmp_path / 'v.zip'}"
    model = trained / "run" / "model"
    local = _evaluate(capsys, model, trained / "valid.txt")
    archived = _evaluate(capsys, model, in_archive)
    assert (archived["average_perplexity"], archived["tokens"]) == (local["average_perplexity"], local["tokens"])
    assert main(["pretrain", "--data", str(trained / "data"), "--output", str(tmp_path / "run"), *TINY[2:],
                 "--init", str(model), "--max-steps", "0", "--valid", in_archive]) == 0
    best = strict_json((tmp_path / "run" / "best" / "valid.json").read_text(encoding="utf-8"))
    assert (best["average_perplexity"], best["data"]) == (local["average_perplexity"], in_archive)


def test_a_signed_url_of_a_manifest_is_its_prepared_folder(trained, capsys):
    """c6a115f took an HTTP URL's query for the end of its path only when joining: a signed URL of a
    prepared folder's manifest (.../data/manifest.json?token=t) no longer ended with manifest.json,
    so evaluate --data read the manifest's JSON lines as text, exit 0 (39 tokens, every one
    unknown). It names its folder, the query going to each file, as the same URL without it does."""
    server = HttpServer(trained)
    try:
        model = trained / "run" / "model"
        local = _evaluate(capsys, model, trained / "data")
        signed = _evaluate(capsys, model, f"{server.url}/ok/data/manifest.json?token=t")
        assert (signed["average_perplexity"], signed["tokens"]) == (local["average_perplexity"], local["tokens"])
        assert {"/ok/data/manifest.json?token=t", "/ok/data/vocab.json?token=t"} <= {p for _, p in server.requests}
    finally:
        server.close()
