"""Runners whose results cannot be checked: DaskRunner is refused before any work, and a runner
whose metrics cannot be read never lets `extract` exit 0 with counts it did not verify (unless
--allow-unverified-counts)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from apache_beam.metrics.metric import MetricResults
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.runners.runner import PipelineResult, PipelineRunner

from elmo_pipeline.cli.main import main
from support import data_path


class NoMetricsRunner(PipelineRunner):
    """Runs the job on the FnApiRunner, then answers as a runner without metrics does: with Beam's
    base PipelineResult, whose metrics() raises NotImplementedError."""

    def run_pipeline(self, pipeline, options):
        return PipelineResult(FnApiRunner().run_pipeline(pipeline, options).wait_until_finish())


class _NoCounters(MetricResults):
    def query(self, filter=None):
        return {self.COUNTERS: [], self.DISTRIBUTIONS: [], self.GAUGES: [], self.STRINGSETS: [],
                self.BOUNDED_TRIES: []}


class _SilentResult(PipelineResult):
    def metrics(self):
        return _NoCounters()


class SilentMetricsRunner(PipelineRunner):
    """Runs the job on the FnApiRunner, then reports metrics that hold no counter at all."""

    def run_pipeline(self, pipeline, options):
        return _SilentResult(FnApiRunner().run_pipeline(pipeline, options).wait_until_finish())


class UnreachableRunner(PipelineRunner):
    """A runner whose cluster cannot be reached: it fails as the job starts (Flink's job server jar
    not downloadable offline, a wrong --job_endpoint)."""

    def run_pipeline(self, pipeline, options):
        raise RuntimeError("cannot reach the job service at localhost:1")


def _runner(cls: type) -> str:
    return f"--runner={cls.__module__}.{cls.__qualname__}"


@pytest.fixture()
def corpus(tmp_path) -> Path:
    src = tmp_path / "in.txt"
    src.write_text("First document. It has two sentences.\nSecond document.\n", encoding="utf-8")
    return src


@pytest.mark.parametrize("runner", ["DaskRunner", "dask", "apache_beam.runners.dask.dask_runner.DaskRunner"])
@pytest.mark.parametrize("command", ["extract", "prepare", "probe"])
def test_dask_runner_is_refused_before_any_work(tmp_path, corpus, capsys, command, runner):
    out = tmp_path / "out"
    inputs = ["--train", str(corpus), "--dev", str(corpus)] if command == "probe" else ["--input", str(corpus)]
    for given in (["--runner", runner], [f"--runner={runner}"]):
        assert main([command, *inputs, "--output", str(out), *given]) == 2
        err = capsys.readouterr().err
        if command == "probe" and len(given) == 2:  # its optional positional took the separate word
            assert "--runner: expected one argument; if you gave it one, write it as --option=VALUE" in err, err
            continue
        assert f"--runner {runner}" in err and "cannot run this job" in err and "finish_bundle" in err, err
        assert not out.exists()


@pytest.mark.parametrize("runner, reason", [
    (NoMetricsRunner, "the runner cannot report metrics (NotImplementedError)"),
    (SilentMetricsRunner, "the runner reported input_files = 0, but the job has 1"),
])
def test_extract_does_not_pass_counts_it_could_not_verify(tmp_path, corpus, model_arg, capsys, runner, reason):
    out = tmp_path / "out"
    argv = ["extract", "--input", str(corpus), "--output", str(out), "--model", model_arg, _runner(runner)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert f"the counts are unverified: {reason}; pass --allow-unverified-counts" in captured.err
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(captured.out) == summary
    assert summary["counts_verified"] is False and summary["counts_unverified_reason"] == reason
    assert summary["documents_reconcile"] is summary["tokens_reconcile"] is summary["ids_unique"] is None
    assert summary["files_reconcile"] is None and summary["rows_in_files"] == 11  # read, but not checked
    # the job itself ran: its rows are there, only the counts are unknown
    assert pq.read_table(next(out.glob("tokens-*.parquet"))).num_rows == 11

    assert main([*argv, "--overwrite", "--allow-unverified-counts"]) == 0
    assert json.loads((out / "summary.json").read_text())["counts_verified"] is False


def test_probe_refuses_an_extraction_it_cannot_verify(tmp_path, model_arg, capsys):
    src = data_path("ud_english_ewt", "en_ewt-ud-dev.conllu")
    lines, blank = [], 0
    with open(src, encoding="utf-8") as f:
        for line in f:
            lines.append(line)
            blank += not line.strip()
            if blank == 4:
                break
    conllu = tmp_path / "mini.conllu"
    conllu.write_text("".join(lines), encoding="utf-8")
    out = tmp_path / "probe"
    assert main(["probe", "--train", str(conllu), "--dev", str(conllu), "--output", str(out), "--model", model_arg,
                 _runner(NoMetricsRunner)]) == 2
    err = capsys.readouterr().err
    assert "the extraction's counts cannot be verified: the runner cannot report metrics" in err, err
    assert not (out / "report.json").exists()


def test_a_runner_that_cannot_start_leaves_the_earlier_run_whole(tmp_path, corpus, capsys, model_arg):
    """--overwrite deleted the earlier run before the runner started; a runner that could not
    start (offline Flink, a wrong job endpoint) left an empty folder."""
    out = tmp_path / "out"
    assert main(["extract", "--input", str(corpus), "--output", str(out), "--model", model_arg]) == 0
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["extract", "--input", str(corpus), "--output", str(out), "--model", model_arg, "--overwrite",
                 _runner(UnreachableRunner)]) == 1  # a job that failed, not a user's error (2)
    assert "extract: the job failed: cannot reach the job service at localhost:1" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing set aside is left hidden either
    # a run that succeeds replaces it, and leaves nothing set aside behind
    assert main(["extract", "--input", str(corpus), "--output", str(out), "--model", model_arg, "--overwrite",
                 "--num-shards", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["errors-00000-of-00001.jsonl", "notes.txt", "summary.json",
                                                     "tokens-00000-of-00002.parquet", "tokens-00001-of-00002.parquet"]


def test_prepare_keeps_its_earlier_run_when_the_runner_cannot_start(tmp_path, corpus, capsys):
    out = tmp_path / "prepared"
    assert main(["prepare", "--input", str(corpus), "--output", str(out), "--tokenizer", "whitespace"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "manifest.json" in before and any(name.startswith("shard-") for name in before)
    assert main(["prepare", "--input", str(corpus), "--output", str(out), "--tokenizer", "whitespace",
                 "--overwrite", _runner(UnreachableRunner)]) == 1
    assert "prepare: the job failed: cannot reach the job service" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
