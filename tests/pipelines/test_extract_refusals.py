"""What `extract` refuses at launch, and what `--overwrite` may delete.

A rerun with `--overwrite` and a bad option used to clear the earlier run's folder, then fail:
every option is now checked (the numbers as argparse parses them, the rest in `prepare_job`)
before anything is deleted, and the earlier run is still there, byte for byte. `--overwrite`
deletes only the names a run writes (the sinks' shard names, summary.json, the sinks' temporary
folders), never a user's file that merely starts with "tokens-" or ends in "summary.json".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elmo_pipeline.cli.main import main
from elmo_pipeline.transforms.embed import EmbedSentences


def exit_code(argv: list[str]) -> int:
    """The command's exit status: what main returns, or argparse's SystemExit for an option it refuses."""
    try:
        return main(argv)
    except SystemExit as stopped:
        return stopped.code


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative name -> bytes): what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory, model_arg) -> tuple[Path, Path]:
    """A complete run: (its input, its output folder)."""
    root = tmp_path_factory.mktemp("earlier")
    src = write(root / "in.txt", "A first document.\nAnd a second one.\n")
    out = root / "out"
    assert main(["extract", "--input", str(src), "--output", str(out), "--model", model_arg,
                 "--dtype", "float32"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["errors-00000-of-00001.jsonl", "summary.json",
                                                      "tokens-00000-of-00001.parquet"]
    return src, out


# bad options -> what the one-line message must say (each names its option)
BAD_OPTIONS = {
    "batch-tokens 0": (["--batch-tokens", "0"], "argument --batch-tokens: must be an integer >= 1, got 0"),
    "max-sentence-tokens 0": (["--max-sentence-tokens", "0"], "argument --max-sentence-tokens: must be an integer"),
    "max-batch-sentences 0": (["--max-batch-sentences", "0"], "argument --max-batch-sentences: must be an integer"),
    "sort-buffer-tokens 0": (["--sort-buffer-tokens", "0"], "argument --sort-buffer-tokens: must be an integer"),
    "torch-threads -1": (["--torch-threads", "-1"], "argument --torch-threads: must be an integer from 0 to 1024"),
    "torch-threads 100000": (["--torch-threads", "100000"], "from 0 to 1024, got 100000"),  # segfaulted torch
    "cache-size 1e20": (["--cache-size", "10" * 10], "argument --cache-size: must be an integer from 0 to 100000000"),
    "split-mb nan": (["--split-mb", "nan"], "argument --split-mb: must be a finite number of MiB above 0"),
    "split-mb inf": (["--split-mb", "inf"], "argument --split-mb: must be a finite number"),
    "split-mb 1e400": (["--split-mb", "1e400"], "argument --split-mb: must be a finite number"),
    "split-mb 0": (["--split-mb", "0"], "argument --split-mb: must be a finite number of MiB above 0"),
    "split-mb -1": (["--split-mb", "-1"], "argument --split-mb: must be a finite number of MiB above 0"),
    "split-mb huge": (["--split-mb", "1e300"], "at most 1048576, got 1e300"),
    "split-mb word": (["--split-mb", "big"], "argument --split-mb: expected a number of MiB, got 'big'"),
    "row-group-mb nan": (["--row-group-mb", "nan"], "argument --row-group-mb: must be a finite number"),
    "row-group-mb inf": (["--row-group-mb", "inf"], "argument --row-group-mb: must be a finite number"),
    "row-group-mb -1": (["--row-group-mb", "-1"], "argument --row-group-mb: must be a finite number"),
    "num-shards -1": (["--num-shards", "-1"], "argument --num-shards: must be an integer from 0 to 1000000, got -1"),
    # failed the job once started ("the job failed: Value out of range", exit 1)
    "num-shards 1e30": (["--num-shards", str(10**30)], "argument --num-shards: must be an integer from 0 to 1000000"),
    "cache-size -1": (["--cache-size", "-1"], "argument --cache-size: must be an integer from 0 to 100000000, got -1"),
    "doc-per file with jsonl": (["--doc-per", "file", "--format", "jsonl"],
                                "--doc-per file needs --format text, not --format jsonl"),
    "id-field with text": (["--id-field", "id"],
                           "--id-field needs --format jsonl or parquet: lines of text have no fields"),
    "timestamp-field with text": (["--timestamp-field", "ts", "--event-time", "field"],
                                  "--timestamp-field needs --format jsonl or parquet"),
    "event-time field alone": (["--event-time", "field"], "--event-time field needs --timestamp-field"),
    # an unset variable: the current folder ("input pattern '' is a folder; give its files, e.g. '/*'")
    "empty input": (["--input", ""], "input pattern '' is empty: give a file, a glob or a URL"),
    "timestamp-field, event-time run": (["--format", "jsonl", "--timestamp-field", "ts", "--event-time", "run"],
                                        "--timestamp-field is read for --event-time field only; with --event-time "
                                        "run no column holds it"),
    "timestamp-field alone": (["--format", "jsonl", "--timestamp-field", "ts"],
                              "--timestamp-field is read for --event-time field only; with --event-time none"),
    "device meta": (["--device", "meta"],
                    "device 'meta': elmo-pipeline runs on cpu or cuda (auto picks one), not meta"),
    "layers none, no mix": (["--layers", "none"], "--layers none writes no layer, so it needs at least one --mix"),
    # two columns DuckDB, Spark and BigQuery take for one: DuckDB's mix_a read mix_A's vectors
    "mix names alike but for case": (["--mix", "A=average", "--mix", "a=top"],
                                     "--mix 'a' and 'A' differ only in case: each needs a column name of its own"),
    "fused kernel, model with clips": (["--kernel", "fused"],
                                       "kernel 'fused' (torch's LSTM op) has no cell or projection clips"),
    "unknown lang": (["--lang", "zz"], "--lang zz: spaCy cannot load it: [E048]"),
    "missing spacy model": (["--spacy-model", "nonexistent_pkg"],
                            "--spacy-model nonexistent_pkg: spaCy cannot load it: [E050]"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_a_bad_option_with_overwrite_leaves_the_earlier_run_untouched(earlier_run, model_arg, capsys, case):
    src, out = earlier_run
    before = snapshot(out)
    bad, message = BAD_OPTIONS[case]
    code = exit_code(["extract", "--input", str(src), "--output", str(out), "--model", model_arg, "--overwrite",
                      *bad])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err
    assert snapshot(out) == before  # nothing deleted, nothing added (no beam-temp-* either)


def test_mix_names_that_would_share_a_column_are_refused_naming_mix_before_the_model_loads(tmp_path, capsys):
    """A pair alike but for case was refused by OutputSpec once the model had loaded, as "mix 'a'
    and 'A' ...", beside parse_mixes' own check of a name given twice: one check, naming --mix, and
    before the model (here one that does not exist) is read."""
    src = write(tmp_path / "in.txt", "One line.\n")
    for mixes, says in ((["a=top", "A=average"], "--mix 'A' and 'a' differ only in case"),
                        (["a=top", "a=average"], "--mix 'a' is named twice")):
        argv = ["extract", "--input", str(src), "--output", str(tmp_path / "out"), "--model", str(tmp_path / "none")]
        assert exit_code(argv + [arg for mix in mixes for arg in ("--mix", mix)]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"elmo-pipeline extract: error: {says}: each needs a column name of its "
                                            "own, also to readers that ignore case (DuckDB, Spark, BigQuery)"], err
    assert not (tmp_path / "out").exists()


def test_an_input_among_the_earlier_runs_files_is_refused_before_clearing(earlier_run, model_arg, capsys):
    _, out = earlier_run
    before = snapshot(out)
    code = exit_code(["extract", "--input", str(out / "errors-*.jsonl"), "--format", "jsonl", "--output", str(out),
                      "--model", model_arg, "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"errors-00000-of-00001.jsonl is output of an earlier run in {out}, which --overwrite deletes" in err
    assert snapshot(out) == before


def test_overwrite_deletes_only_what_a_run_writes(tmp_path, model_arg):
    src = write(tmp_path / "in.txt", "One short document.\n")
    out = tmp_path / "out"
    stale = {  # what earlier runs of any layout and shard count, or a killed one, left
        "tokens-00000-of-00003.parquet": "old", "sentences-00001-of-00002.parquet": "old",
        "errors-00000-of-00004.jsonl": "old", "summary.json.partial": "old", "summary.json.0123abcd.partial": "old",
        "beam-temp-tokens-0123456789abcdef0123456789abcdef/x.parquet": "old",
        "beam-temp-errors-fedcba9876543210fedcba9876543210/x": "old",
    }
    kept = {  # the user's: names that merely look like run output
        "my_summary.json": "mine", "summary.json.bak": "mine", "summary.json.notes.partial": "mine",
        "tokens-notes.txt": "mine",
        "errors-analysis/notes.txt": "mine", "sentences-to-check.jsonl": "mine", "beam-temp-notes/a.txt": "mine",
        "tokens-00000-of-00001.parquet/inside.txt": "a folder, not a shard",
    }
    for name, text in {**stale, **kept}.items():
        write(out / name, text)
    assert main(["extract", "--input", str(src), "--output", str(out), "--model", model_arg]) == 2  # refused
    assert snapshot(out) == {name: text.encode() for name, text in {**stale, **kept}.items()}

    assert main(["extract", "--input", str(src), "--output", str(out), "--model", model_arg, "--overwrite",
                 "--num-shards", "2"]) == 0
    files = snapshot(out)
    assert {name: files[name] for name in kept} == {name: text.encode() for name, text in kept.items()}
    ours = sorted(set(files) - set(kept))
    assert ours == ["errors-00000-of-00001.jsonl", "summary.json", "tokens-00000-of-00002.parquet",
                    "tokens-00001-of-00002.parquet"]
    summary = json.loads(files["summary.json"])
    assert summary["documents_read"] == 1
    # the footers read are the two shards', not the user's folder named like one
    assert summary["files_reconcile"] and summary["rows_in_files"] == summary["tokens"] == 4


def test_prepare_overwrite_keeps_a_users_file_named_like_a_shard(tmp_path):
    src = write(tmp_path / "in.txt", "a b c\nd e\n")
    out = tmp_path / "prepared"
    assert main(["prepare", "--input", str(src), "--output", str(out), "--tokenizer", "whitespace"]) == 0
    (out / "shard-notes.txt").write_text("mine")  # started with "shard-", so it was taken for the run's
    assert main(["prepare", "--input", str(src), "--output", str(out), "--tokenizer", "whitespace", "--overwrite"]) == 0
    assert (out / "shard-notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["errors.jsonl", "manifest.json", "shard-00000-of-00001.parquet",
                                                     "shard-notes.txt", "vocab.json"]


def test_prepare_checks_the_tokenizer_and_fields_before_clearing(tmp_path, capsys):
    src = write(tmp_path / "in.txt", "w1 w2\n")
    out = tmp_path / "prepared"
    assert main(["prepare", "--input", str(src), "--output", str(out), "--tokenizer", "whitespace"]) == 0
    before = snapshot(out)
    for bad, message in ((["--lang", "zz"], "--lang zz: spaCy cannot load it"),
                         (["--spacy-model", "nonexistent_pkg"], "--spacy-model nonexistent_pkg: spaCy cannot"),
                         (["--id-field", "id"], "--id-field needs --format jsonl or parquet"),
                         (["--doc-per", "file", "--format", "jsonl"], "--doc-per file needs --format text"),
                         (["--split-mb", "nan"], "argument --split-mb: must be a finite number"),
                         (["--input", str(tmp_path / "nothing-*.txt")], "matches no files"),
                         (["--input", str(out / "vocab.json")], "vocab.json is output of an earlier run in"),
                         (["--direct_num_workers=-1"], "--direct_num_workers must be >= 0, got -1")):
        assert exit_code(["prepare", "--input", str(src), "--output", str(out), "--overwrite", *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert snapshot(out) == before


@pytest.mark.parametrize("command", ["prepare", "probe"])
def test_an_output_beams_sinks_cannot_write_is_refused_before_the_job(tmp_path, capsys, command):
    src = write(tmp_path / "in.txt", "w1 w2\n")
    head = {"prepare": ["--input", str(src), "--tokenizer", "whitespace"],
            "probe": ["--train", str(src), "--dev", str(src)]}[command]
    assert main([command, *head, "--output", "memory://elmo-refusals/out"]) == 2
    err = capsys.readouterr().err
    assert "--output memory://elmo-refusals/out: Beam's file sinks cannot write there" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["extract", "prepare", "probe"])
def test_an_output_name_that_is_not_utf8_is_refused_before_the_job(tmp_path, capsys, model_arg, command):
    """A name of bytes that are not UTF-8 (a shell passes them as they are) failed the started job
    ("the job failed: 'utf-8' codec can't encode characters", exit 1)."""
    src = write(tmp_path / "in.txt", "w1 w2\n")
    head = {"extract": ["--input", str(src), "--model", model_arg],
            "prepare": ["--input", str(src), "--tokenizer", "whitespace"],
            "probe": ["--train", str(src), "--dev", str(src)]}[command]
    output = os.fsdecode(bytes(tmp_path) + b"/out-\xff")
    assert main([command, *head, "--output", output]) == 2
    err = capsys.readouterr().err
    assert f"--output {output!r}: the name is not UTF-8" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


@pytest.mark.parametrize("files", [[], ["--train", "T", "--dev", "T"]])
def test_an_empty_probe_data_folder_is_refused_not_dropped(tmp_path, capsys, files):
    """`probe "$DATA" --output out` with the variable unset: the empty folder was taken for none
    given, so --train/--dev ran instead (or the message asked for them, naming no folder)."""
    src = write(tmp_path / "in.conllu", "1\tw1\t_\tX\t_\t_\t0\troot\t_\t_\n\n")
    argv = [str(src) if word == "T" else word for word in files]
    assert main(["probe", "", *argv, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "elmo-pipeline probe: error: the data folder '' names no folder; give one, or --train and --dev" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("files, says", [
    (["D", "--train", ""], "--train '' names no file; give one (or a data folder)"),
    (["--train", "", "--dev", "T"], "--train '' names no file; give one (or a data folder)"),
    (["--train", "T", "--dev", " "], "--dev ' ' names no file; give one (or a data folder)")])
def test_an_empty_probe_train_or_dev_file_is_refused_by_name(tmp_path, capsys, files, says):
    """`probe DATA --train "$T"` with the variable unset ran on the data folder as if --train were
    not given, and `--train '' --dev x` asked for --train and --dev without naming the empty one."""
    src = write(tmp_path / "in.conllu", "1\tw1\t_\tX\t_\t_\t0\troot\t_\t_\n\n")
    for split in ("train", "dev"):
        write(tmp_path / "data" / f"x-{split}.conllu", "1\tw1\t_\tX\t_\t_\t0\troot\t_\t_\n\n")
    argv = [str(src) if word == "T" else str(tmp_path / "data") if word == "D" else word for word in files]
    assert main(["probe", *argv, "--output", str(tmp_path / "out")]) == 2
    assert f"elmo-pipeline probe: error: {says}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_probe_name_that_is_not_utf8_is_refused_before_any_work(tmp_path, capsys):
    # the chart's title: matplotlib failed with a traceback once the extraction and training were done
    src = write(tmp_path / "in.conllu", "1\tw1\t_\tX\t_\t_\t0\troot\t_\t_\n\n")
    name = os.fsdecode(b"task-\xff")
    assert main(["probe", "--train", str(src), "--dev", str(src), "--name", name,
                 "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"elmo-pipeline probe: error: --name {name!r} is not UTF-8 text" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["extract", "prepare", "probe"])
@pytest.mark.parametrize("name", ["o*x", "o?x", "o[x]", "o{a,b}x"])
def test_an_output_that_beams_sinks_would_read_as_a_pattern_is_refused(tmp_path, capsys, command, name):
    """Beam's sinks clear `<output>/tokens-*-of-N.parquet` as a pattern: an output `o*x` deleted the
    shards of a folder `old-x` beside it, and `o[x]` failed after the whole job."""
    src = write(tmp_path / "in.txt", "w1 w2\n")
    beside = write(tmp_path / "old-x" / "tokens-00000-of-00001.parquet", "an earlier run's shard")
    write(tmp_path / "old-x" / "errors.jsonl", "")
    head = {"extract": ["--input", str(src)], "prepare": ["--input", str(src), "--tokenizer", "whitespace"],
            "probe": ["--train", str(src), "--dev", str(src)]}[command]
    assert main([command, *head, "--output", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path / name}: holds " in err and "which Beam's file sinks read as a pattern" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in beside.parent.iterdir()) == ["errors.jsonl", "tokens-00000-of-00001.parquet"]
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("command", ["extract", "prepare", "probe"])
def test_a_second_run_into_a_folder_being_written_is_refused(tmp_path, capsys, command, model_arg):
    """Two runs on one new folder were not excluded: each cleared or replaced the other's shards,
    and one could exit 0 with its output gone. The first holds a lock on the folder (here: this
    test, as another process would)."""
    import fcntl
    import os

    src = write(tmp_path / "in.txt", "w1 w2\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    head = {"extract": ["--input", str(src), "--model", model_arg],
            "prepare": ["--input", str(src), "--tokenizer", "whitespace", "--overwrite"],
            "probe": ["--train", str(src), "--dev", str(src)]}[command]
    holder = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert main([command, *head, "--output", str(out)]) == 2
    finally:
        os.close(holder)
    err = capsys.readouterr().err
    assert f"--output {out} is being written by another run (extract, prepare or probe) now; wait for it to end" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    if command == "extract":  # the lock gone with its holder, the run goes ahead
        assert main([command, *head, "--output", str(out)]) == 0
        assert (out / "summary.json").exists()


def test_the_refusal_says_a_run_killed_with_overwrite_left_the_one_before_it_aside(tmp_path, capsys, model_arg):
    """It said "(3 files)" for two temporary folders and the whole earlier run, set aside."""
    src = write(tmp_path / "in.txt", "w1 w2\n")
    out = tmp_path / "out"
    write(out / ".earlier-run-x1y2" / "tokens-00000-of-00001.parquet", "the run before")
    write(out / "beam-temp-tokens-0123456789abcdef0123456789abcdef" / "part", "partial")
    assert main(["extract", "--input", str(src), "--output", str(out), "--model", model_arg]) == 2
    assert (f"{out} already holds output of an earlier run (2 files; .earlier-run-x1y2 holds the run before a run "
            "that was killed part way, whole: move its files back to keep it, as --overwrite deletes it too); use "
            "--overwrite") in capsys.readouterr().err


def test_a_folder_made_for_a_run_that_is_refused_is_not_left_behind(tmp_path, capsys):
    src = write(tmp_path / "in.txt", "w1 w2\n")
    assert main(["extract", "--input", str(src), "--output", str(tmp_path / "new"), "--model", "/no/such/model"]) == 2
    capsys.readouterr()
    assert not (tmp_path / "new").exists()


def test_beams_azure_scheme_is_refused_naming_the_output(tmp_path, capsys):
    src = write(tmp_path / "in.txt", "w1 w2\n")
    assert main(["extract", "--input", str(src), "--output", "azfs://account/container/out"]) == 2
    err = capsys.readouterr().err
    assert "--output azfs://account/container/out: the command also checks and clears the output folder through " \
           "fsspec, which cannot open it (Protocol not known: azfs)" in err and "Traceback" not in err


def test_similarity_names_an_unknown_lang(capsys, model_arg):
    assert main(["similarity", "--word", "bank", "the bank rose", "a river bank", "--lang", "zz",
                 "--model", model_arg]) == 2
    err = capsys.readouterr().err
    assert "elmo-pipeline similarity: error: --lang zz: spaCy cannot load it: [E048]" in err and "Traceback" not in err


def test_the_transform_refuses_what_the_command_line_does():
    # for pipelines built in Python: the same bounds as the options, before a worker meets them
    with pytest.raises(ValueError, match="torch_threads must be from 0 to 1024"):
        EmbedSentences(torch_threads=1025)
    with pytest.raises(ValueError, match="cache_size must be >= 0, got -1"):
        EmbedSentences(cache_size=-1)


def test_a_refused_run_into_new_nested_folders_leaves_none_of_them(tmp_path):
    """`--output a/b/out` with a model that is not there made a/, a/b/ and out/ for the run's claim
    and removed only out/: the refused run left a/b/ behind, empty."""
    corpus = write(tmp_path / "in.txt", "One sentence.\n")
    assert exit_code(["extract", "--input", str(corpus), "--output", str(tmp_path / "a" / "b" / "out"),
                      "--model", str(tmp_path / "no-model")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]
