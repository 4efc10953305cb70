"""Nothing on the command line of a Beam command (extract, prepare, probe) is dropped silently:
several inputs after one --input are all read, and an argument that neither the command nor any
Beam PipelineOptions class knows stops the command before any work, naming it and the nearest
known option."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from elmo_pipeline.cli.main import main
from elmo_pipeline.pipelines import extract, prepare, probe
from elmo_pipeline.pipelines.beam_options import BeamArgsError, check_beam_args
from elmo_pipeline.training.shards import PreparedCorpus

MISSING_MODEL = "/nonexistent/model"  # loading it would fail: an error about it means work started


def write_texts(folder: Path, texts: dict[str, str]) -> list[Path]:
    paths = []
    for name, text in texts.items():
        path = folder / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def test_extract_reads_every_input_after_one_input_option(tmp_path, model_arg, capsys):
    a, b, c = write_texts(tmp_path, {"a.txt": "One document.\n", "b.txt": "Two documents here.\nAnd a third.\n",
                                     "c.txt": "The last one.\n"})
    out = tmp_path / "out"
    # what a shell makes of `--input data/*.txt`, then a repeated --input
    assert main(["extract", "--input", str(a), str(b), "--input", str(c), "--output", str(out),
                 "--model", model_arg]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["input_files"], summary["documents_read"], summary["tokens"]) == (3, 4, 15)
    table = pq.read_table(next(out.glob("tokens-*.parquet")))
    assert sorted(set(table.column("doc_id").to_pylist())) == [f"{a}:1", f"{b}:1", f"{b}:2", f"{c}:1"]


def test_prepare_reads_every_input_after_one_input_option(tmp_path):
    files = write_texts(tmp_path, {"a.txt": "w1 w2\n", "b.txt": "w3\nw4 w5 w6\n", "c.txt": "w7\n"})
    out = tmp_path / "prepared"
    assert main(["prepare", "--input", *map(str, files), "--output", str(out), "--tokenizer", "whitespace"]) == 0
    manifest = PreparedCorpus(str(out)).manifest
    assert (manifest.sentences, manifest.tokens) == (4, 7)


# command, its arguments, the misspelt ones, and what the message must say
REFUSED = {
    "extract ours": ("extract", ["--input", "IN", "--output", "OUT", "--model", MISSING_MODEL],
                     ["--batch-tokenz", "64"], "--batch-tokenz (did you mean --batch-tokens?)"),
    "extract Beam's": ("extract", ["--input", "IN", "--output", "OUT", "--model", MISSING_MODEL],
                       ["--direct_running_mode=multi_processing", "--direct_num_worker=2"],
                       "--direct_num_worker (did you mean --direct_num_workers?)"),
    "prepare": ("prepare", ["--input", "IN", "--output", "OUT"], ["--shard-tokenz", "100"],
                "--shard-tokenz (did you mean --shard-tokens?)"),
    "probe": ("probe", ["--train", "IN", "--dev", "IN", "--output", "OUT", "--model", MISSING_MODEL],
              ["--epohcs", "3"], "--epohcs (did you mean --epochs?)"),
}
MODULE_MAINS = {"extract": extract.main, "prepare": prepare.main, "probe": probe.main}


def _argv(tmp_path: Path, head: list[str], bad: list[str]) -> tuple[list[str], Path]:
    src = write_texts(tmp_path, {"in.txt": "A document.\n"})[0]
    out = tmp_path / "out"
    return [str(src) if a == "IN" else str(out) if a == "OUT" else a for a in head] + bad, out


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_unknown_option_stops_the_command_before_any_work(tmp_path, capsys, case):
    command, head, bad, message = REFUSED[case]
    argv, out = _argv(tmp_path, head, bad)
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert f"elmo-pipeline {command}: error: unrecognized argument" in err and message in err, err
    assert MISSING_MODEL not in err  # refused before the model was looked for
    assert not out.exists()

    assert MODULE_MAINS[command](argv) == 2  # python -m elmo_pipeline.pipelines.<command>: the same message
    err = capsys.readouterr().err
    assert f"elmo-pipeline {command}: error: unrecognized argument" in err and message in err, err
    assert not out.exists()


def test_a_stray_word_is_an_error_too(tmp_path, capsys):
    argv, out = _argv(tmp_path, ["--input", "IN", "--output", "OUT", "--model", MISSING_MODEL], ["more.txt"])
    assert main(["extract", *argv]) == 2
    assert "'more.txt' (not an option)" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("args", [
    ["--runner=PortableRunner", "--job_endpoint=localhost:8099", "--environment_type=EXTERNAL",
     "--environment_config=localhost:50000"],
    ["--direct_running_mode", "multi_processing", "--direct_num_workers", "2"],
    ["--direct_running_mode=multi_threading", "--direct_num_workers=4"],
    ["--runner", "DataflowRunner", "--project", "P", "--region", "us-central1", "--temp_location", "gs://B/tmp",
     "--experiments", "use_runner_v2", "--experiments=no_use_multiple_sdk_containers",
     "--sdk_container_image", "IMAGE", "--dataflow_service_options", "worker_accelerator=type:nvidia-l4;count:1",
     "--machine_type", "g2-standard-8", "--number_of_worker_harness_threads", "1", "--save_main_session"],
    ["--runner", "FlinkRunner", "--flink_master", "HOST:8081", "--environment_type", "EXTERNAL",
     "--environment_config", "localhost:50000", "--sdk_worker_parallelism", "1"],
    ["--runner", "SparkRunner", "--spark_master_url", "spark://HOST:7077"],
    ["--runner=apache_beam.runners.direct.direct_runner.BundleBasedDirectRunner"],
])
def test_beam_options_of_the_docs_and_tests_are_accepted(args):
    check_beam_args(args, extract.add_extract_args)


def test_a_value_beam_rejects_and_an_unknown_runner_are_named():
    with pytest.raises(BeamArgsError, match="--direct_num_workers: invalid int value: 'two'"):
        check_beam_args(["--direct_num_workers", "two"])
    with pytest.raises(BeamArgsError, match="--sdk_worker_parallelism: invalid int value: 'x'"):
        check_beam_args(["--sdk_worker_parallelism=x"])  # Beam takes it as text; int() named no option
    with pytest.raises(BeamArgsError, match=r"--runner Flinkk: unknown runner \(did you mean FlinkRunner\?\)"):
        check_beam_args(["--runner", "Flinkk"])


def test_a_beam_option_given_twice_with_different_values_and_runtime_type_check_are_refused():
    """Beam kept the last value without a word; Beam 2.77's runtime type check fails every file
    sink's finalize step once the whole job has run."""
    with pytest.raises(BeamArgsError, match=re.escape("given more than once with different values, of which only "
                                                      "the last would count: --direct_num_workers ('2', '3'); give "
                                                      "each once")):
        check_beam_args(["--direct_num_workers=2", "--direct_num_workers", "3"])
    with pytest.raises(BeamArgsError, match=re.escape("--runner ('BundleBasedDirectRunner', 'FnApiRunner')")):
        check_beam_args(["--runner=BundleBasedDirectRunner", "--runner", "FnApiRunner"])
    check_beam_args(["--direct_num_workers=2", "--direct_num_workers", "2", "--experiments=a", "--experiments=b"])
    with pytest.raises(BeamArgsError, match=r"^--runtime_type_check: Beam 2.77's runtime type check fails"):
        check_beam_args(["--runtime_type_check"])
    check_beam_args(["--performance_runtime_type_check"])


def test_beams_runtime_type_check_fails_a_plain_file_sink(tmp_path):
    """Why --runtime_type_check is refused: Beam's own WriteToText fails with it (when this passes,
    a Beam upgrade fixed it and the refusal can go)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    with pytest.raises(Exception, match="type-hint"):
        with beam.Pipeline(options=PipelineOptions(["--runtime_type_check"])) as p:
            p | beam.Create(["a", "b"]) | beam.io.WriteToText(str(tmp_path / "out"))


@pytest.mark.parametrize("command", ["extract", "prepare"])
def test_type_check_strictness_all_required_stops_the_command_before_any_work(tmp_path, capsys, command):
    """Beam's own Create and file sinks declare no output type, so the pipeline could not be built:
    the command ended in a traceback (TypeCheckError: ... no output type-hint was found)."""
    head = REFUSED["extract ours" if command == "extract" else "prepare"][1]
    for spelling in (["--type_check_strictness=ALL_REQUIRED"], ["--type_check_strictness", "ALL_REQUIRED"]):
        argv, out = _argv(tmp_path, head, spelling)
        assert main([command, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"elmo-pipeline {command}: error: --type_check_strictness=ALL_REQUIRED: Beam 2.77's "
                              "own transforms"), err
        assert "Traceback" not in err and MISSING_MODEL not in err and not out.exists()
    check_beam_args(["--type_check_strictness=DEFAULT_TO_ANY", "--type_check_additional=all"])


def test_beams_own_file_sink_cannot_be_built_with_all_required_type_checks(tmp_path):
    """Why ALL_REQUIRED is refused (when this passes, a Beam upgrade fixed it and the refusal can go)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    p = beam.Pipeline(options=PipelineOptions(["--type_check_strictness=ALL_REQUIRED"]))
    with pytest.raises(Exception, match="no output type-hint was found"):
        _ = p | beam.Create(["a"]).with_output_types(str) | beam.io.WriteToText(str(tmp_path / "out"))


def test_fp16_on_cpu_stops_extract_before_any_work(tmp_path, model_arg, capsys):
    (a,) = write_texts(tmp_path, {"a.txt": "One document.\n"})
    assert main(["extract", "--input", str(a), "--output", str(tmp_path / "out"), "--model", model_arg,
                 "--device", "cpu", "--precision", "fp16"]) == 2
    assert "fp16 autocast is for GPUs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_module_entry_points_end_a_users_error_as_the_cli_does(tmp_path, capsys):
    """`python -m elmo_pipeline.pipelines.extract` and the others: one line and exit 2, as `elmo-pipeline`."""
    argv, out = _argv(tmp_path, ["--input", "IN", "--output", "OUT"], ["--lang", "zz"])
    assert MODULE_MAINS["extract"](argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("elmo-pipeline extract: error: --lang zz: spaCy cannot load it") and "Traceback" not in err
    assert not out.exists()


def test_local_paths_the_workers_use_are_made_absolute(tmp_path, monkeypatch):
    """A portable runner's workers run in a folder of their own: a relative --output wrote the
    shards beside them while the launcher reported success."""
    import argparse

    import spacy

    from elmo_pipeline.pipelines.paths import make_paths_absolute

    monkeypatch.chdir(tmp_path)
    spacy.blank("en").to_disk("spm")
    args = argparse.Namespace(output="out/run", model="m/options.json,m/weights.hdf5", spacy_model="spm")
    make_paths_absolute(args)
    assert (args.output, args.model, args.spacy_model) == (
        f"{tmp_path}/out/run", f"{tmp_path}/m/options.json,{tmp_path}/m/weights.hdf5", f"{tmp_path}/spm")
    urls = argparse.Namespace(output="gs://b/out", model="s3://b/m", spacy_model="not_installed_anywhere")
    make_paths_absolute(urls)
    assert (urls.output, urls.model, urls.spacy_model) == ("gs://b/out", "s3://b/m", "not_installed_anywhere")
    bare = argparse.Namespace(output="x", model=None)  # no spacy_model (probe), no model (the default)
    make_paths_absolute(bare)
    assert (bare.output, bare.model) == (f"{tmp_path}/x", None)


def test_an_output_folder_this_process_cannot_write_is_refused_before_the_job(tmp_path):
    """A read-only output made probe and prepare start the job and log Beam's traceback."""
    import os
    import subprocess
    import sys

    locked = tmp_path / "locked"
    locked.mkdir()
    check = ("from elmo_pipeline.pipelines.paths import check_beam_writable\n"
             f"check_beam_writable({str(locked / 'sub')!r})")
    if os.geteuid() != 0:
        locked.chmod(0o555)
        run = [sys.executable, "-c", check]
    else:  # root writes anywhere a mode allows nothing: a read-only bind mount stops it too
        mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
        run = ["unshare", "-m", "--propagation", "private", "bash", "-c", mount, str(locked), sys.executable, "-c",
               check]
    done = subprocess.run(run, capture_output=True, text=True)
    if os.geteuid() == 0 and "mount" in done.stderr and "ValueError" not in done.stderr:
        pytest.skip(f"no read-only bind mount here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 1
    assert (f"ValueError: --output {locked / 'sub'} cannot be written: {locked}, where it would be made, is not "
            "writable by this process") in done.stderr
    assert subprocess.run([sys.executable, "-c", check.replace("locked", "open")]).returncode == 0


@pytest.mark.parametrize("argv, message", [
    (["similarity", "--word", "bank", "--wrod", "x", "a bank", "the bank"],
     "elmo-pipeline similarity: error: unrecognized argument: --wrod (did you mean --word?)"),
    (["evaluate", "--data", "x", "--batch-tokenz", "8", "stray"],
     "elmo-pipeline evaluate: error: unrecognized arguments: --batch-tokenz (did you mean --batch-tokens?); "
     "'stray' (not an option)"),
])
def test_an_unknown_argument_of_a_command_without_beam_is_named_by_that_command(argv, message, capsys):
    """They printed the top-level usage and no nearest option."""
    from elmo_pipeline.cli.main import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.startswith(f"usage: elmo-pipeline {argv[0]} ") and err.rstrip().endswith(message), err


@pytest.mark.parametrize("argv, repeated", [
    (["evaluate", "--data", "one.txt", "--data", "two.txt"], "--data ('one.txt', 'two.txt')"),
    (["extract", "--input", "IN", "--output", "OUT", "--dtype", "float16", "--dtype=float32", "--out", "x"],
     "--output ('OUT', 'x'); --dtype ('float16', 'float32')"),  # "--out": argparse's abbreviation of --output
    (["pretrain", "--data", "d", "--output", "r", "--lr", "0.1", "--lr", "0.2"], "--lr ('0.1', '0.2')"),
])
def test_an_option_of_one_value_given_twice_is_refused(argv, repeated, capsys):
    """argparse kept the last value and dropped the others: `evaluate --data a --data b` read b only."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(
        f"error: given more than once with different values, of which only the last would count: {repeated}; "
        "give each once")


def test_an_option_given_twice_with_one_value_and_appended_options_are_accepted(tmp_path, capsys):
    argv, out = _argv(tmp_path, ["--input", "IN", "--input", "IN", "--output", "OUT", "--output", "OUT"],
                      ["--model", MISSING_MODEL])
    assert MODULE_MAINS["extract"](argv) == 2  # past the parsing: the missing model is what stops it
    assert MISSING_MODEL in capsys.readouterr().err
    with pytest.raises(SystemExit):
        MODULE_MAINS["extract"](argv + ["--output", str(tmp_path / "other")])
    assert "--output (" in capsys.readouterr().err


def test_every_option_has_help_and_its_default_shown_once():
    """`extract --help` gave no help, so no default, for --dtype (float16), --precision or
    --max-batch-sentences, and none of --batch-tokens' 8192; a help that names its default keeps
    its own words."""
    from elmo_pipeline.cli.main import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        assert [a.dest for a in command._actions if not a.help] == [], name
        text = " ".join(command.format_help().split())
        assert "(default: auto) (default" not in text and "%(default)" not in text, name
    extract_help = " ".join(sub.choices["extract"].format_help().split())
    for shown in ("stored precision of the vectors (default: float16)", "(default: 8192)",
                  "sentences per model batch, at most (default: 1024)", "auto, cpu, cuda (default: auto)"):
        assert shown in extract_help, shown
    assert "--overwrite replace earlier output in --output --format" in extract_help  # a flag: no default


def test_the_help_says_compression_is_also_told_by_the_first_bytes(tmp_path, capsys):
    """`embed-file --help` and `extract --help` said compression is told by the extension only,
    where a gzip named .txt is read decompressed (by its first bytes), as the README says."""
    import gzip

    import h5py

    from elmo_pipeline.cli.main import build_parser, main

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert "compression by extension or first bytes" in " ".join(sub.choices["embed-file"].format_help().split())
    for command in ("extract", "prepare"):
        assert ".gz/.bz2/.xz/.zst by extension or first bytes" in " ".join(sub.choices[command].format_help().split())
    (tmp_path / "in.txt").write_bytes(gzip.compress(b"one two three\nfour\n"))
    assert main(["embed-file", str(tmp_path / "in.txt"), str(tmp_path / "out.h5"), "--quiet", "--top"]) == 0
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert (f["0"].shape[0], f["1"].shape[0]) == (3, 1)


def test_a_flag_shows_no_default_of_its_destination():
    """`pretrain --help` said `--no-grow-vocab ... keep the model's vocabulary (default: True)`, the
    default of grow_vocab, read as if keeping were the default; `embed-file --top` and `--average`
    each said `(default: all)`."""
    from elmo_pipeline.cli.main import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    pretrain_help = " ".join(sub.choices["pretrain"].format_help().split())
    assert "instead of adding the corpus's new words --softmax" in pretrain_help
    embed_help = " ".join(sub.choices["embed-file"].format_help().split())
    assert "--top top layer: (n_tokens, 2P) --average mean of the layers: (n_tokens, 2P) --batch-size" in embed_help
    assert "sentences per batch (default: 64)" in embed_help  # an option with a value keeps its default
