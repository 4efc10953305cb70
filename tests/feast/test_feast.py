"""extract -> feast-repo -> feast apply -> offline (historical) and online retrieval, with the real Feast.

The Feast tests need the `feast` extra; locally they skip without it, under CI=true they fail.
The checks of refused features (float16, no event time, sentence layout) need neither Feast nor a model.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from elmo_pipeline.cli import main as cli
from elmo_pipeline.feast.repo import (
    FeatureFilesError, RepoOptions, inspect_features, materialize_command, parse_options, parse_ttl, write_repo,
)
from elmo_pipeline.corpus.schema import OutputSpec
from elmo_pipeline.model.scalar_mix import MixSpec
from support import data_path

SENTENCES = [
    "Apple sold more phones this year. I ate an apple after lunch.",
    "The bank raised its rates. We sat on the river bank.",
    "ELMo gives each token a vector that depends on its sentence.",
]


def require_feast():
    if importlib.util.find_spec("feast") is None:
        reason = "feast is not installed (pip install 'elmo-pipeline[feast]')"
        if os.environ.get("CI", "").lower() == "true":
            raise ImportError(reason)
        pytest.skip(reason)
    import feast

    return feast


def _model_arg() -> str:
    d = data_path("allennlp_elmo")
    return f"{d / 'options.json'},{d / 'lm_weights.hdf5'}"


def _extract(out: Path, *args: str) -> dict:
    from elmo_pipeline.pipelines.extract import main

    assert main(["--output", str(out), "--model", _model_arg(), "--dtype", "float32", "--mix", "avg=average",
                 *args]) == 0
    return json.loads((out / "summary.json").read_text())


def _read_tokens(folder: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(folder.glob("tokens-*.parquet")))


@pytest.fixture(scope="module")
def run_time_features(tmp_path_factory):
    """Two input files, two shards (one of them empty for such a small corpus), event time = run start."""
    root = tmp_path_factory.mktemp("feast_run")
    (root / "a.txt").write_text("\n".join(SENTENCES[:2]) + "\n", encoding="utf-8")
    (root / "b.txt").write_text(SENTENCES[2] + "\n", encoding="utf-8")
    out = root / "features"
    summary = _extract(out, "--input", str(root / "a.txt"), "--input", str(root / "b.txt"),
                       "--event-time", "run", "--num-shards", "2")
    assert summary["tokens_reconcile"] and summary["token_rows_written"] > 20
    return out


@pytest.fixture(scope="module")
def field_time_features(tmp_path_factory):
    """JSONL documents carrying their own event time (one without it, which is rejected: a row
    without an event time would never be materialized)."""
    root = tmp_path_factory.mktemp("feast_field")
    docs = [{"id": "d1", "text": SENTENCES[0], "ts": "2024-05-01T12:00:00Z"},
            {"id": "d2", "text": SENTENCES[1], "ts": "2024-06-02T08:30:00+02:00"},
            {"id": "d3", "text": SENTENCES[2]}]
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    out = root / "features"
    summary = _extract(out, "--input", str(root / "docs.jsonl"), "--format", "jsonl", "--id-field", "id",
                       "--event-time", "field", "--timestamp-field", "ts")
    (error,) = [json.loads(line) for f in out.glob("errors-*.jsonl") for line in f.read_text().splitlines()]
    assert (error["doc_id"], error["line"], error["reason"]) == ("d3", 3, "missing timestamp field 'ts'")
    assert summary["read_errors"] == 1
    return out


def _as_f32(value) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


# ---------------------------------------------------------------- the event time extract writes


def test_event_time_run_is_the_run_start(run_time_features):
    table = _read_tokens(run_time_features)
    assert table.schema.field("event_timestamp").type == pa.timestamp("us", tz="UTC")
    started = json.loads(table.schema.metadata[b"elmo_pipeline"])["started"]
    expected = datetime.fromisoformat(started.replace("Z", "+00:00"))
    assert set(table.column("event_timestamp").to_pylist()) == {expected}
    for name in ("layer_0", "layer_1", "layer_2", "mix_avg"):
        assert table.schema.field(name).type.value_type == pa.float32()


def test_event_time_field_carries_the_document_time(field_time_features):
    rows = _read_tokens(field_time_features).select(["doc_id", "event_timestamp"]).to_pylist()
    by_doc = {}
    for r in rows:
        by_doc.setdefault(r["doc_id"], set()).add(r["event_timestamp"])
    assert by_doc == {"d1": {datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)},
                      "d2": {datetime(2024, 6, 2, 6, 30, tzinfo=timezone.utc)}}  # +02:00 normalised to UTC
    files = inspect_features(str(field_time_features))
    assert files.null_timestamps == 0
    assert files.min_timestamp == datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)
    assert files.max_timestamp == datetime(2024, 6, 2, 6, 30, tzinfo=timezone.utc)
    assert materialize_command(files) == "feast materialize 2024-05-01T12:00:00 2024-06-02T06:30:01"


# ---------------------------------------------------------------- the Feast round trip


@pytest.fixture
def feast_import_isolation(monkeypatch):
    """`feast apply` run in-process appends the repo to sys.path and imports `features`; undo both, or a second
    repo in the same process would re-use the first one's cached module."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop("features", None)
    yield
    sys.modules.pop("features", None)


def _feast_repo(features: Path, repo: Path, capsys, *options: str):
    """feast-repo (with `options`), then `feast apply` through Feast's own CLI; (store, feast CLI runner,
    materialize args)."""
    feast = require_feast()
    from click.testing import CliRunner
    from feast.cli.cli import cli as feast_cli

    assert cli.main(["feast-repo", "--features", str(features), "--output", str(repo), "--project", "elmo_test",
                     *options]) == 0
    printed = capsys.readouterr().err
    materialize = next(line.split()[1:] for line in printed.splitlines()
                       if line.strip().startswith("feast materialize"))
    text = (repo / "features.py").read_text()
    assert "Array(Float32)" in text and "tokens-*.parquet" in text
    assert (repo / "feature_store.yaml").read_text().count("sqlite") == 1

    runner = CliRunner()

    def run_feast(*args: str) -> None:
        result = runner.invoke(feast_cli, ["--chdir", str(repo), *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output

    run_feast("apply")
    return feast.FeatureStore(repo_path=str(repo)), run_feast, materialize, printed


@pytest.mark.filterwarnings("ignore::FutureWarning:dask")
def test_feast_offline_and_online_return_the_parquet_vectors(run_time_features, tmp_path, capsys,
                                                            feast_import_isolation):
    feast = require_feast()
    repo = tmp_path / "repo"
    store, run_feast, materialize, _ = _feast_repo(run_time_features, repo, capsys)
    view = store.get_feature_view("elmo_tokens")
    vectors = ["layer_0", "layer_1", "layer_2", "mix_avg"]
    assert [f.name for f in view.features] == vectors
    assert all(str(f.dtype) == str(feast.types.Array(feast.types.Float32)) for f in view.features)
    assert [e.name for e in view.entity_columns] == ["token_id"]

    table = _read_tokens(run_time_features)
    expected = {r["token_id"]: r for r in table.select(["token_id", "event_timestamp", *vectors]).to_pylist()}
    assert len(expected) == table.num_rows  # token_id is a unique key
    event_time = next(iter(expected.values()))["event_timestamp"]
    ids = sorted(expected)[::2] + ["no-such-doc:0:0:0"]
    service = store.get_feature_service("elmo_vectors")

    # offline: a point-in-time join. An entity time before the event time sees no vectors: Feast 0.67's file
    # offline store drops such entity rows (other stores return nulls), so both are accepted for them.
    import pandas as pd

    later = event_time + timedelta(minutes=1)
    entity_df = pd.DataFrame({"token_id": ids + ids[:2],
                              "event_timestamp": [later] * len(ids) + [event_time - timedelta(seconds=1)] * 2})
    history = store.get_historical_features(entity_df=entity_df, features=service).to_df()
    history["is_later"] = history["event_timestamp"] == pd.Timestamp(later)
    assert sorted(history.loc[history["is_later"], "token_id"]) == sorted(ids)
    for row in history.to_dict("records"):
        known = row["token_id"] in expected and row["is_later"]
        for name in vectors:
            value = row[name]
            if known:
                assert np.array_equal(_as_f32(value), _as_f32(expected[row["token_id"]][name])), (row["token_id"], name)
            else:
                assert value is None or (np.isscalar(value) and pd.isna(value)), (row["token_id"], name, value)

    # online: materialize into SQLite with the command feast-repo printed, then serve
    run_feast(*materialize)
    assert (repo / "data" / "online_store.db").exists()
    online = store.get_online_features(features=service, entity_rows=[{"token_id": i} for i in ids]).to_dict()
    assert online["token_id"] == ids
    for name in vectors:
        for token_id, value in zip(ids, online[name]):
            if token_id in expected:
                assert np.array_equal(_as_f32(value), _as_f32(expected[token_id][name])), (token_id, name)
            else:
                assert value is None


@pytest.mark.filterwarnings("ignore::FutureWarning:dask")
def test_feast_with_document_event_times(field_time_features, tmp_path, capsys, feast_import_isolation):
    """Per-document times from 2024: the printed materialize range covers them (materialize-incremental with
    ttl 0 would start a year before now), and point-in-time joins respect each document's time."""
    store, run_feast, materialize, printed = _feast_repo(field_time_features, tmp_path / "repo", capsys)
    assert materialize == ["materialize", "2024-05-01T12:00:00", "2024-06-02T06:30:01"]
    expected = {r["token_id"]: r for r in _read_tokens(field_time_features).to_pylist()}
    assert "no event_timestamp" not in printed  # the untimed d3 was rejected by extract, not written
    ids = ["d1:0:0:0", "d1:0:0:3", "d2:0:0:1", "d3:0:0:0"]
    service = store.get_feature_service("elmo_vectors")

    import pandas as pd

    between = datetime(2024, 5, 15, tzinfo=timezone.utc)  # after d1's time, before d2's
    history = store.get_historical_features(
        entity_df=pd.DataFrame({"token_id": ids, "event_timestamp": [between] * len(ids)}), features=service).to_df()
    got = {r["token_id"]: r["layer_2"] for r in history.to_dict("records")}
    for token_id in ("d1:0:0:0", "d1:0:0:3"):
        assert np.array_equal(_as_f32(got[token_id]), _as_f32(expected[token_id]["layer_2"]))
    assert "d2:0:0:1" not in got or got["d2:0:0:1"] is None or pd.isna(got["d2:0:0:1"])

    run_feast(*materialize)
    online = store.get_online_features(features=service, entity_rows=[{"token_id": i} for i in ids]).to_dict()
    for token_id, value in zip(online["token_id"], online["mix_avg"]):
        if token_id not in expected:
            assert value is None  # never written
        else:
            assert np.array_equal(_as_f32(value), _as_f32(expected[token_id]["mix_avg"]))


# ---------------------------------------------------------------- what is refused, and options


def _write(folder: Path, spec: OutputSpec, name: str = "tokens-00000-of-00001.parquet") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(spec.schema().empty_table(), folder / name)
    return folder


def test_float16_features_are_refused_with_the_fix(tmp_path, capsys):
    folder = _write(tmp_path / "f16", OutputSpec(n_layers=3, width=8, dtype="float16", mix_names=("avg",),
                                                 with_timestamp=True))
    with pytest.raises(FeatureFilesError, match=r"float16.*Feast has no float16.*--dtype float32"):
        write_repo(str(folder), str(tmp_path / "repo"))
    assert not (tmp_path / "repo").exists()
    assert cli.main(["feast-repo", "--features", str(folder), "--output", str(tmp_path / "repo")]) == 2
    assert "re-run extract with --dtype float32" in capsys.readouterr().err


def test_missing_event_time_and_sentence_layout_are_explained(tmp_path):
    folder = _write(tmp_path / "no_time", OutputSpec(n_layers=3, width=8, dtype="float32"))
    with pytest.raises(FeatureFilesError, match=r"no event_timestamp.*--event-time run"):
        inspect_features(str(folder))
    folder = _write(tmp_path / "sentences", OutputSpec(n_layers=3, width=8, dtype="float32", layout="sentence",
                                                       with_timestamp=True), "sentences-00000-of-00001.parquet")
    with pytest.raises(FeatureFilesError, match=r"--layout token"):
        inspect_features(str(folder))
    folder = _write(tmp_path / "no_vectors", OutputSpec(n_layers=3, width=8, dtype="float32", layers="none",
                                                        with_timestamp=True))
    with pytest.raises(FeatureFilesError, match=r"no vector columns"):
        inspect_features(str(folder))
    with pytest.raises(FileNotFoundError):
        inspect_features(str(tmp_path / "absent"))


def test_repo_options_reach_the_files(tmp_path):
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", layers="top",
                                                 mix_names=("avg", "task"), with_timestamp=True))
    (folder / "errors-00000-of-00001.jsonl").write_text("")
    options = RepoOptions(project="p1", feature_view="fv", feature_service="svc", columns=("mix_task",),
                          ttl=parse_ttl("90d"), online_store="redis",
                          online_options=parse_options(["connection_string=localhost:6379", "db=2"], "x"),
                          offline_store="duckdb")
    files, _ = write_repo(str(folder), str(tmp_path / "repo"), options)
    assert files.vector_columns == ("layer_2", "mix_avg", "mix_task") and files.width == 8
    assert files.source_path == str(folder / "tokens-*.parquet")
    config = (tmp_path / "repo" / "feature_store.yaml").read_text()
    assert 'type: "redis"' in config and 'connection_string: "localhost:6379"' in config and "db: 2" in config
    assert 'type: "duckdb"' in config and "path:" not in config
    text = (tmp_path / "repo" / "features.py").read_text()
    assert "name='mix_task'" in text and "name='mix_avg'" not in text and "timedelta(seconds=7776000)" in text
    compile(text, "features.py", "exec")
    with pytest.raises(FileExistsError):
        write_repo(str(folder), str(tmp_path / "repo"), options)
    with pytest.raises(ValueError, match="not in the features"):
        write_repo(str(folder), str(tmp_path / "repo2"), RepoOptions(columns=("layer_0",)))
    for bad in ({"project": "bad-name"}, {"entity": "elmo_vectors"}, {"feature_view": "Field"},
                {"feature_service": "class"}):
        with pytest.raises(ValueError):
            RepoOptions(**bad)
    assert parse_ttl("0") == timedelta(0) and parse_ttl("12h") == timedelta(hours=12)
    with pytest.raises(ValueError, match="more than Python's longest duration"):
        parse_ttl("99999999999w")
    with pytest.raises(ValueError, match=re.escape("ttl '0.0000001s': shorter than a microsecond, which Feast would "
                                                   "read as 0 (never expire)")):
        parse_ttl("0.0000001s")  # it became timedelta(0): vectors that never expire
    assert parse_ttl("0.000001s") == timedelta(microseconds=1) and parse_ttl("0.0") == timedelta(0)
    for name in ("elmo\n", "elmo\nx"):  # a newline after a valid name is not a name either
        with pytest.raises(ValueError):
            RepoOptions(project=name)


@pytest.mark.parametrize("item", ["a: b=1", "x\ntype=evil", "path\n=1", "-x=1"])
def test_a_store_option_key_that_would_rewrite_the_yaml_is_refused(item):
    with pytest.raises(ValueError, match="KEY must be letters, digits and underscores"):
        parse_options([item], "--offline-option")
    assert parse_options(["connection_string=a: b\nc", "_n=2"], "x") == {"connection_string": "a: b\nc", "_n": 2}


def test_a_features_path_cannot_inject_code_into_the_definitions(tmp_path):
    # the path was written raw into the module docstring: '"""' ended it and what followed ran
    spec = OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True)
    marker = tmp_path / "ran"
    for name in (f'inj"""+__import__("os").system("touch {marker}")+"""x', "bs\\N"):
        folder = _write(tmp_path / name, spec)
        write_repo(str(folder), str(tmp_path / "repo"), overwrite=True)
        text = (tmp_path / "repo" / "features.py").read_text()
        tree = ast.parse(text)  # bs\N in a docstring was a SyntaxError
        sources = [n for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg == "path"]
        assert [ast.literal_eval(k.value) for k in sources] == [f"{glob.escape(str(folder))}/tokens-*.parquet"]
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "system"]
    assert not marker.exists()


def test_store_options_are_written_whole_and_never_dropped(tmp_path, capsys):
    # a JSON object's key made a key of the file ("registry"), and a repeated or type key won in silence
    value = {"a: 1\nregistry": "/tmp/evil.db", "b #": [1, {}]}
    options = parse_options([f"x={json.dumps(value)}", "y={}"], "--offline-option")
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    write_repo(str(folder), str(tmp_path / "repo"), RepoOptions(offline_options=options))
    config = yaml.safe_load((tmp_path / "repo" / "feature_store.yaml").read_text())
    assert config["offline_store"] == {"type": "file", "x": value, "y": {}}
    assert config["registry"] == "data/registry.db"
    for items, says in ((["path=a", "path=b"], "--online-option path= is given twice ('a' and 'b'): give it once"),
                        (["type=redis"], "the store's type is its --offline-store / --online-store option"),
                        (['x={"a": 1, "a": 2}'], "duplicate key 'a'")):
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_options(items, "--online-option")
    out = tmp_path / "repo2"
    assert cli.main(["feast-repo", "--features", str(folder), "--output", str(out), "--online-path", "a.db",
                 "--online-option", "path=b.db"]) == 2
    assert "--online-path a.db and --online-option path= both give the online store's path" in capsys.readouterr().err
    assert cli.main(["feast-repo", "--features", str(folder), "--output", str(out), "--columns", "layer_2,layer_2"]) == 2
    assert "columns ['layer_2'] are given more than once" in capsys.readouterr().err
    assert not out.exists()


def test_a_repo_that_cannot_be_written_whole_is_not_begun(tmp_path, capsys):
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    repo = tmp_path / "repo"
    (repo / "features.py").mkdir(parents=True)
    (repo / "feature_store.yaml").write_text("OLD")
    assert cli.main(["feast-repo", "--features", str(folder), "--output", str(repo), "--overwrite"]) == 2
    assert f"{repo / 'features.py'} is a folder; the repository's file cannot replace it" in capsys.readouterr().err
    assert (repo / "feature_store.yaml").read_text() == "OLD"
    (tmp_path / "afile").write_text("x")
    assert cli.main(["feast-repo", "--features", str(folder), "--output", str(tmp_path / "afile")]) == 2
    assert f"--output {tmp_path / 'afile'} is an existing file; it must name a folder" in capsys.readouterr().err


def test_features_of_a_run_that_failed_or_did_not_finish_are_served_with_a_warning(tmp_path, capsys):
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    argv = ["feast-repo", "--features", str(folder), "--output", str(tmp_path / "repo"), "--overwrite"]
    assert cli.main(argv) == 0
    assert f"warning: {folder} has no summary.json: the extract run that wrote it may not have finished" in \
        capsys.readouterr().err
    summary = {"documents_reconcile": True, "tokens_reconcile": True, "files_reconcile": True, "ids_unique": False,
               "vectors_finite": False}
    (folder / "summary.json").write_text(json.dumps(summary))
    assert cli.main(argv) == 0
    assert (f"warning: {folder / 'summary.json'} says ids_unique: false, vectors_finite: false: the run that wrote "
            "these features failed its checks") in capsys.readouterr().err
    (folder / "summary.json").write_text(json.dumps({**summary, "ids_unique": None, "vectors_finite": True}))
    assert cli.main(argv) == 0
    # an output of no row (these shards are empty) was served without a word
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        f"warning: {folder / 'tokens-*.parquet'}: its files hold no rows ({folder / 'tokens-00000-of-00001.parquet'}): "
        "the feature view would serve no token"]


def test_features_of_a_run_whose_error_records_were_lost_are_served_with_a_warning(tmp_path, capsys):
    """extract's errors_reconcile (its errors-*.jsonl against the rejects it counted) is one of
    the checks a run can fail, and exit 1 on: feast-repo said nothing of it."""
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    summary = {"documents_reconcile": True, "tokens_reconcile": True, "files_reconcile": True,
               "errors_reconcile": False, "ids_unique": True, "vectors_finite": True}
    (folder / "summary.json").write_text(json.dumps(summary))
    argv = ["feast-repo", "--features", str(folder), "--output", str(tmp_path / "repo")]
    assert cli.main(argv) == 0
    assert (f"warning: {folder / 'summary.json'} says errors_reconcile: false: the run that wrote these features "
            "failed its checks") in capsys.readouterr().err


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    bad = tmp_path / "tokens-00000-of-00001.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(FeatureFilesError, match=rf"^{re.escape(str(bad))}: not a readable Parquet file"):
        inspect_features(str(bad))


def test_features_behind_a_url(tmp_path):
    import fsspec

    spec = OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True)
    data = pa.BufferOutputStream()
    pq.write_table(spec.schema().empty_table(), data)
    fs = fsspec.filesystem("memory")
    for shard in range(2):
        fs.pipe(f"/feast-test/out/tokens-0000{shard}-of-00002.parquet", data.getvalue().to_pybytes())
    fs.pipe("/feast-test/out/summary.json", b"{}")
    try:
        files = inspect_features("memory://feast-test/out")
        assert files.source_path == "memory:///feast-test/out/tokens-*.parquet"
        assert len(files.files) == 2 and files.files[0].startswith("memory://")
        assert files.num_rows == 0 and files.min_timestamp is None
        assert materialize_command(files).startswith("feast materialize-incremental")
    finally:
        fs.rm("/feast-test", recursive=True)


# ---------------------------------------------------------------- from the audit of the command line


@pytest.mark.parametrize("url", ["memory://v-repo", "s3://bucket/repo", "gs://bucket/repo"])
def test_an_output_url_is_refused_not_made_a_local_folder(tmp_path, monkeypatch, capsys, url):
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    monkeypatch.chdir(tmp_path)
    protocol = url.split(":", 1)[0]
    with pytest.raises(ValueError, match=rf"^--output {re.escape(url)}: the Feast repository is a local folder"):
        write_repo(str(folder), url)
    assert cli.main(["feast-repo", "--features", str(folder), "--output", url]) == 2
    assert f"not a {protocol}:// URL" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f32"]  # no folder `memory:` or `s3:`
    files, written = write_repo(str(folder), (tmp_path / "repo").as_uri())  # file:// is local
    assert written == [str(tmp_path / "repo" / "feature_store.yaml"), str(tmp_path / "repo" / "features.py")]


def test_an_existing_folder_with_glob_characters_is_that_folder(tmp_path):
    import fsspec

    spec = OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True)
    folder = _write(tmp_path / "f[1]", spec)
    _write(tmp_path / "f1", spec, "tokens-00000-of-00002.parquet")  # what `f[1]` matches as a glob
    _write(tmp_path / "f1", spec, "tokens-00001-of-00002.parquet")
    files = inspect_features(str(folder))
    assert files.files == (str(folder / "tokens-00000-of-00001.parquet"),)
    # the FileSource's reader globs its path too: escaped, it finds this folder's file and no other
    assert files.source_path == f"{tmp_path}/f[[]1]/tokens-*.parquet"
    assert fsspec.filesystem("file").glob(files.source_path) == list(files.files)
    (single,) = inspect_features(str(folder / "tokens-00000-of-00001.parquet")).files
    assert single == str(folder / "tokens-00000-of-00001.parquet")
    assert len(inspect_features(str(tmp_path / "f[1-9]" / "tokens-*.parquet")).files) == 2  # not there: a glob


def test_a_hidden_parquet_file_beside_the_features_is_not_read(tmp_path):
    # macOS leaves `._NAME` beside each file it copies: a folder's `*.parquet` took `._part.parquet`,
    # and the command stopped with "not a readable Parquet file", where every other reader skips it
    import fsspec

    spec = OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True)
    folder = _write(tmp_path / "copied", spec, "part.parquet")
    (folder / "._part.parquet").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    files = inspect_features(str(folder))
    assert files.files == (str(folder / "part.parquet"),) and files.width == 8
    # the FileSource's reader globs its path too: it finds that file and not the hidden one
    assert fsspec.filesystem("file").glob(files.source_path) == list(files.files)
    # a glob of the user's is the FileSource's path as it is: one matching the hidden file is refused
    with pytest.raises(FeatureFilesError, match=rf"also matches the hidden file {re.escape(str(folder))}/\._part"):
        inspect_features(str(folder / "*.parquet"))
    assert inspect_features(str(folder / "p*.parquet")).files == files.files


@pytest.mark.filterwarnings("ignore::FutureWarning:dask")
def test_feast_serves_the_features_of_a_folder_named_with_brackets(run_time_features, tmp_path, capsys,
                                                                   feast_import_isolation):
    import shutil

    folder = tmp_path / "run [1]"
    shutil.copytree(run_time_features, folder)
    store, run_feast, materialize, _ = _feast_repo(folder, tmp_path / "repo", capsys)
    assert "[[]1]" in (tmp_path / "repo" / "features.py").read_text()
    run_feast(*materialize)
    expected = {r["token_id"]: r["layer_2"] for r in _read_tokens(folder).to_pylist()}
    ids = sorted(expected)[:3]
    online = store.get_online_features(features=store.get_feature_service("elmo_vectors"),
                                       entity_rows=[{"token_id": i} for i in ids]).to_dict()
    for token_id, value in zip(ids, online["layer_2"]):
        assert np.array_equal(_as_f32(value), _as_f32(expected[token_id])), token_id


@pytest.mark.parametrize("ttl, note", [("0", "# 0: the vectors never expire"),
                                       ("90d", "# 90d: historical retrieval leaves out a vector older than this"),
                                       ("3600s", "# 1h: historical"), ("2w", "# 2w: historical"), ("90s", "# 90s: h"),
                                       ("1.5s", "# 1.5s: historical")])
def test_the_ttl_comment_says_the_ttl_given(tmp_path, ttl, note):
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    write_repo(str(folder), str(tmp_path / "repo"), RepoOptions(ttl=parse_ttl(ttl)))
    (line,) = [line for line in (tmp_path / "repo" / "features.py").read_text().splitlines() if "ttl=" in line]
    assert note in line, line
    assert ("never expire" in line) == (ttl == "0")


def test_next_steps_are_shell_quoted(tmp_path):
    from elmo_pipeline.feast.repo import next_steps

    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    files = inspect_features(str(folder))
    assert next_steps("fr/q ü", files) == ["cd 'fr/q ü'", "feast apply", materialize_command(files)]
    assert next_steps("it's", files)[0] == """cd 'it'"'"'s'"""
    assert next_steps("plain/repo", files)[0] == "cd plain/repo"


def test_shards_of_another_mix_under_one_name_are_refused(tmp_path):
    """Two runs' shards whose --mix task=FILE named other weights: Feast would serve either mix's
    vector as mix_task for a token. A shard of the same mix is one run's."""
    def spec(weights):
        return OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True, mix_names=("task",),
                          metadata={"model": {"sha256": "a" * 64}, "mixes": {"task": MixSpec(weights).to_dict()}})

    folder = _write(tmp_path / "run", spec((0.0, 1.0, -1.0)), "tokens-00000-of-00002.parquet")
    _write(folder, spec((1.0, 0.0, 0.0)), "tokens-00001-of-00002.parquet")
    with pytest.raises(FeatureFilesError, match=rf"^{re.escape(str(folder / 'tokens-00001-of-00002.parquet'))}: its "
                                                r"mix_task hold another mix than .*tokens-00000-of-00002.parquet's"):
        inspect_features(str(folder))
    _write(folder, spec((0.0, 1.0, -1.0)), "tokens-00001-of-00002.parquet")
    assert inspect_features(str(folder)).vector_columns == ("layer_0", "layer_1", "layer_2", "mix_task")


def test_features_that_are_not_one_runs_whole_output_are_refused_or_warned(tmp_path, capsys):
    """Another model's shard beside a run's is refused (Feast would serve either vector for a
    token); a shard lost or added since the run, or a stray copy that the FileSource's glob
    matches, is a warning naming it."""
    spec = OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True, metadata={"model": {"sha256": "a" * 64}})
    folder = _write(tmp_path / "run", spec, "tokens-00000-of-00002.parquet")
    _write(folder, OutputSpec(**{**spec.__dict__, "metadata": {"model": {"sha256": "b" * 64}}}),
           "tokens-00001-of-00002.parquet")
    with pytest.raises(FeatureFilesError, match=rf"^{re.escape(str(folder / 'tokens-00001-of-00002.parquet'))}: its "
                                                "vectors are of another model than"):
        inspect_features(str(folder))
    # the same layers read from other files (another sha256): one model's vectors
    layers = {"sha256": "a" * 64, "layers_sha256": "c" * 64}
    _write(folder, OutputSpec(**{**spec.__dict__, "metadata": {"model": layers}}), "tokens-00000-of-00002.parquet")
    _write(folder, OutputSpec(**{**spec.__dict__, "metadata": {"model": {**layers, "sha256": "b" * 64}}}),
           "tokens-00001-of-00002.parquet")
    assert inspect_features(str(folder)).vector_columns == ("layer_0", "layer_1", "layer_2")
    _write(folder, spec, "tokens-00000-of-00002.parquet")
    _write(folder, spec, "tokens-00001-of-00002.parquet")
    (folder / "summary.json").write_text(json.dumps({"files_reconcile": True, "rows_in_files": 0}))
    argv = ["feast-repo", "--features", str(folder), "--output", str(tmp_path / "repo"), "--overwrite"]
    assert cli.main(argv) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        f"warning: {folder / 'tokens-*.parquet'}: its files hold no rows ({folder / 'tokens-00000-of-00002.parquet'}, "
        f"{folder / 'tokens-00001-of-00002.parquet'}): the feature view would serve no token"]
    (folder / "tokens-00001-of-00002.parquet").rename(folder / "tokens-00000-of-00002 (copy).parquet")
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert (f"warning: {folder / 'tokens-*.parquet'}: tokens-00000-of-00002 (copy).parquet is not named as extract "
            "names its shards; Feast would serve these files as they are") in err
    assert "1 of the 2 shards missing: tokens-00001-of-00002.parquet" in err
    (folder / "tokens-00000-of-00002 (copy).parquet").rename(folder / "tokens-00001-of-00002.parquet")
    (folder / "summary.json").write_text(json.dumps({"files_reconcile": True, "rows_in_files": 7}))
    assert cli.main(argv) == 0
    assert (f"warning: {folder / 'summary.json'} says its run wrote 7 rows, and the files hold 0: files were lost, "
            "added or changed since") in capsys.readouterr().err


def test_vectors_rewritten_as_variable_size_lists_are_refused_with_the_fix(tmp_path):
    """pandas writes a fixed-size list column back as list<float>: its width would be unknown (0)."""
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    path = folder / "tokens-00000-of-00001.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.schema.get_field_index("layer_1"), "layer_1",
                                    table.column("layer_1").cast(pa.list_(pa.float32()))), path)
    with pytest.raises(FeatureFilesError, match=r"column layer_1 is list<\w+: float>, but extract writes fixed-size "
                                                r"lists of one width; .*cast back to fixed-size lists"):
        inspect_features(str(folder))


def test_a_repository_the_disk_cannot_hold_is_not_written_in_half(tmp_path, capsys, monkeypatch):
    """A full disk after feature_store.yaml left it beside an empty features.py, which `feast
    apply` took as a project without features; with --overwrite the old pair lost a file."""
    import errno
    from pathlib import Path as _Path

    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    repo = tmp_path / "repo"
    argv = ["feast-repo", "--features", str(folder), "--output", str(repo), "--overwrite"]
    assert cli.main(argv) == 0
    before = {p.name: p.read_bytes() for p in repo.iterdir()}
    write_text = _Path.write_text

    def full_disk(self, text, *args, **kwargs):
        if ".py." in self.name:  # the definitions' temporary file
            write_text(self, text[:10], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(_Path, "write_text", full_disk)
    assert cli.main(argv + ["--project", "other"]) == 2
    assert f"cannot write {repo / 'features.py'}: No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in repo.iterdir()} == before  # the old pair, and nothing else


def test_an_empty_features_option_is_refused_not_taken_for_the_current_folder(tmp_path, capsys, monkeypatch):
    """`--features "$DIR"` with the variable unset served the Parquet files of the current folder
    (a repository written, exit 0); it is refused by name, and nothing is written."""
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    monkeypatch.chdir(folder)
    out = tmp_path / "repo"
    for value in ("", " "):
        assert cli.main(["feast-repo", "--features", value, "--output", str(out)]) == 2
        assert (f"elmo-pipeline feast-repo: error: --features {value!r} names no folder, file or glob"
                in capsys.readouterr().err)
        assert not out.exists()
    assert cli.main(["feast-repo", "--features", str(folder), "--output", str(out)]) == 0  # named, it is served
    assert sorted(p.name for p in out.iterdir()) == ["feature_store.yaml", "features.py"]


@pytest.mark.parametrize("option, says", [
    ("--provider", "provider '' is empty"), ("--registry", "registry ' ' is empty"),
    ("--offline-store", "offline store '' is empty"), ("--online-store", "online store ' ' is empty"),
    ("--online-path", "--online-path '' names no file"), ("--columns", "--columns ' , ' names no column"),
])
def test_an_empty_store_setting_or_column_list_is_refused_before_the_repo_is_written(tmp_path, capsys, option,
                                                                                      says):
    # `--registry "$REG"` with the variable unset: an empty provider, registry or store type was
    # written as "" (feast apply then failed with a traceback: registry "" is the repo folder), and
    # an empty --online-path or --columns was dropped (the default path; every column served)
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    value = re.search(r"'(.*)'", says).group(1)
    out = tmp_path / "repo"
    assert cli.main(["feast-repo", "--features", str(folder), "--output", str(out), option, value]) == 2
    assert f"elmo-pipeline feast-repo: error: {says}" in capsys.readouterr().err
    assert not out.exists()


_SIGNAL_AFTER_DEFINITIONS = """
import os, sys
from pathlib import Path
write_text = Path.write_text
def write_then_signal(self, text, *args, **kwargs):
    written = write_text(self, text, *args, **kwargs)
    if ".py." in self.name:  # the definitions' temporary file, feature_store.yaml's written before it
        os.kill(os.getpid(), {signum})
    return written
Path.write_text = write_then_signal
from elmo_pipeline.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [2, 15])
def test_a_signal_while_the_repository_is_written_leaves_it_as_it_was(tmp_path, signum):
    """Ctrl-C or SIGTERM between the temporary files and their renames left both temporary files in
    the repository (only an OSError removed them)."""
    folder = _write(tmp_path / "f32", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    repo = tmp_path / "repo"
    argv = ["feast-repo", "--features", str(folder), "--output", str(repo), "--overwrite"]
    assert cli.main(argv) == 0
    before = {p.name: p.read_bytes() for p in repo.iterdir()}
    run = subprocess.run([sys.executable, "-c", _SIGNAL_AFTER_DEFINITIONS.format(signum=signum), *argv,
                          "--project", "other"], capture_output=True, text=True, timeout=60)
    said = "interrupted" if signum == 2 else "terminated (SIGTERM)"
    assert (run.returncode, run.stderr) == (128 + signum, f"elmo-pipeline feast-repo: {said}\n")
    assert {p.name: p.read_bytes() for p in repo.iterdir()} == before  # the old pair, and nothing else


# ---------------------------------------------------------------- event times, runs and settings of what is served


def _top_spec(**metadata) -> OutputSpec:
    """Token shards of the top layer in float32 with event times, as feast-repo takes them; `metadata` is
    the run's (its `started`, its model)."""
    return OutputSpec(n_layers=3, width=8, dtype="float32", layers="top", with_timestamp=True, metadata=metadata)


def _rows(folder: Path, spec: OutputSpec, times: list[datetime], name: str = "tokens-00000-of-00001.parquet",
          doc: str = "d") -> pa.Table:
    """A shard of one row per time, doc `doc`'s tokens 0, 1, ...; each vector column holds values
    of its own (the row's index, the column's)."""
    columns = spec.vector_columns
    n = len(times)
    values = {"token_id": [f"{doc}:0:0:{i}" for i in range(n)], "doc_id": [doc] * n, "sentence_index": [0] * n,
              "window_index": [0] * n, "token_index": list(range(n)), "token": ["w"] * n,
              "char_start": list(range(n)), "char_end": list(range(1, n + 1)), "event_timestamp": times}
    values.update({c: [[i + k / 8 + j / 64 for k in range(spec.width)] for i in range(n)]
                   for j, c in enumerate(columns)})
    table = pa.Table.from_pydict(values, schema=spec.schema())
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / name)
    return table


def _one_run(folder: Path, spec: OutputSpec, rows: int, doc: str = "d") -> pa.Table:
    """An extract run's folder: a shard of `rows` tokens at one event time and a summary.json that counts them."""
    table = _rows(folder, spec, [datetime(2024, 5, 1, tzinfo=timezone.utc)] * rows, doc=doc)
    (folder / "summary.json").write_text(json.dumps({"rows_in_files": rows}))
    return table


@pytest.mark.filterwarnings("ignore::FutureWarning:dask")
def test_a_time_in_the_calendars_last_second_is_materialized(tmp_path, capsys, feast_import_isolation):
    """An event time in 9999-12-31T23:59:59 (a document's own time) stopped feast-repo with
    'OverflowError: date value out of range' after it had written the repository (exit 1, a
    traceback, no next steps): the END it prints was that time plus a second. END is the
    calendar's last microsecond there, and Feast materializes that row from it."""
    spec = _top_spec()
    last = datetime(9999, 12, 31, 23, 59, 59, 900000, tzinfo=timezone.utc)
    table = _rows(tmp_path / "f32", spec, [datetime(2024, 1, 1, tzinfo=timezone.utc), last])
    files = inspect_features(str(tmp_path / "f32"))
    assert materialize_command(files) == "feast materialize 2024-01-01T00:00:00 9999-12-31T23:59:59.999999"
    store, run_feast, materialize, _ = _feast_repo(tmp_path / "f32", tmp_path / "repo", capsys)
    assert materialize == ["materialize", "2024-01-01T00:00:00", "9999-12-31T23:59:59.999999"]
    run_feast(*materialize)
    ids = table.column("token_id").to_pylist()
    online = store.get_online_features(features=store.get_feature_service("elmo_vectors"),
                                       entity_rows=[{"token_id": i} for i in ids]).to_dict()
    for got, expected in zip(online["layer_2"], table.column("layer_2").to_pylist()):
        assert np.array_equal(_as_f32(got), _as_f32(expected))


def test_files_of_several_runs_are_served_with_a_warning(tmp_path, capsys):
    """A glob over two runs' folders (one corpus extracted twice, say at two precisions, with the
    documents' own times) was served without a word, though every token_id was in both at one
    event time: Feast's historical retrieval gave one run's vectors, then the other's, from one
    call to the next. The runs are told apart by the metadata's `started`."""
    def spec(started: str) -> OutputSpec:
        return _top_spec(model={"sha256": "a" * 64}, started=started)

    when = [datetime(2024, 5, 1, tzinfo=timezone.utc)] * 3
    for run, started in (("run1", "2026-01-01T10:00:00Z"), ("run2", "2026-01-02T10:00:00Z")):
        _one_run(tmp_path / run, spec(started), 3)
    says = (f"warning: {tmp_path}/run*/tokens-*.parquet: its files are of 2 extract runs (started "
            "2026-01-01T10:00:00Z, 2026-01-02T10:00:00Z): a token_id in more than one is served from the run of the later event_timestamp, "
            "and at equal times (the same documents' own times) from either run")
    argv = ["feast-repo", "--output", str(tmp_path / "repo"), "--overwrite", "--features"]
    assert cli.main([*argv, str(tmp_path / "run*" / "tokens-*.parquet")]) == 0
    err = capsys.readouterr().err
    assert says in err and "(2 files, 6 rows)" in err
    # a shard of the other run in a run's folder: the names are one run's whole set
    _rows(tmp_path / "run1", spec("2026-01-02T10:00:00Z"), when, "tokens-00000-of-00002.parquet", doc="e")
    _rows(tmp_path / "run1", spec("2026-01-01T10:00:00Z"), when, "tokens-00001-of-00002.parquet", doc="f")
    (tmp_path / "run1" / "tokens-00000-of-00001.parquet").unlink()
    (tmp_path / "run1" / "summary.json").write_text(json.dumps({"rows_in_files": 6}))
    assert cli.main([*argv, str(tmp_path / "run1")]) == 0
    assert (f"warning: {tmp_path / 'run1' / 'tokens-*.parquet'}: its files are of 2 extract runs"
            in capsys.readouterr().err)
    one_run = ["feast-repo", "--output", str(tmp_path / "repo2"), "--features", str(tmp_path / "run2")]
    assert cli.main(one_run) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::FutureWarning:dask")
def test_a_repository_rewritten_over_other_features_warns_of_the_vectors_online(tmp_path, capsys,
                                                                              feast_import_isolation):
    """--overwrite over a repository that served other features, under the same feature view: after
    feast apply and materialize, the online store still served the earlier features' vectors for
    every token_id the new ones lack (3 of 3; another model's, had the run been one). That is said,
    with the remedy (a new --feature-view), which serves only the new features."""
    tables = {}
    for folder, started, n in (("a", "2026-01-01T10:00:00Z", 3), ("b", "2026-01-02T10:00:00Z", 2)):
        tables[folder] = _one_run(tmp_path / folder, _top_spec(started=started), n, doc=folder)
    repo = tmp_path / "repo"
    feast = require_feast()
    _, run_feast, materialize, _ = _feast_repo(tmp_path / "a", repo, capsys)
    run_feast(*materialize)

    def online() -> dict[str, list]:
        """apply and materialize the repository as it now is; the vectors served for each folder's tokens"""
        sys.modules.pop("features", None)  # feast apply imports the rewritten definitions afresh
        run_feast("apply")
        run_feast(*materialize)
        store = feast.FeatureStore(repo_path=str(repo))
        ids = {k: t.column("token_id").to_pylist() for k, t in tables.items()}
        got = store.get_online_features(features=store.get_feature_service("elmo_vectors"),
                                        entity_rows=[{"token_id": i} for i in ids["a"] + ids["b"]]).to_dict()
        return {"a": got["layer_2"][:3], "b": got["layer_2"][3:]}

    def same(got: list, folder: str) -> list[bool]:
        return [v is not None and np.array_equal(_as_f32(v), _as_f32(e))
                for v, e in zip(got, tables[folder].column("layer_2").to_pylist())]

    argv = ["feast-repo", "--features", str(tmp_path / "b"), "--output", str(repo), "--project", "elmo_test",
            "--overwrite"]
    assert cli.main(argv) == 0
    assert (f"warning: {repo / 'features.py'} served {tmp_path / 'a'}/tokens-*.parquet (extract started "
            "2026-01-01T10:00:00Z) under the feature view elmo_tokens: an online store materialized from those keeps "
            "their vectors, and serves them for every token_id these features lack") in capsys.readouterr().err
    served = online()
    assert same(served["a"], "a") == [True] * 3 and same(served["b"], "b") == [True] * 2
    assert cli.main(argv) == 0  # the same features again: nothing to say
    assert "warning" not in capsys.readouterr().err
    assert cli.main(argv + ["--feature-view", "elmo_tokens_b"]) == 0  # a new view: a new online table
    assert "warning" not in capsys.readouterr().err
    served = online()
    assert served["a"] == [None] * 3 and same(served["b"], "b") == [True] * 2


@pytest.mark.parametrize("year", [1500, 2300])
def test_event_times_that_feasts_file_store_cannot_sort_are_warned_of(tmp_path, capsys, year):
    """Documents' own times of 1500 or 2300 were served without a word; over two files, Feast's
    file offline store (pandas' nanosecond times) stopped `feast materialize` with
    OutOfBoundsDatetime (historical retrieval too, for 1500), and nothing was served online."""
    spec = _top_spec()
    _rows(tmp_path / "f", spec, [datetime(year, 1, 1, tzinfo=timezone.utc)], "tokens-00000-of-00002.parquet")
    _rows(tmp_path / "f", spec, [datetime(2024, 1, 1, tzinfo=timezone.utc)], "tokens-00001-of-00002.parquet", "e")
    argv = ["feast-repo", "--features", str(tmp_path / "f"), "--output", str(tmp_path / "repo"), "--overwrite"]
    assert cli.main(argv) == 0
    first, last = sorted([f"{year}-01-01T00:00:00+00:00", "2024-01-01T00:00:00+00:00"])
    assert (f"warning: {tmp_path / 'f' / 'tokens-*.parquet'}: event times from {first} to {last}, and Feast's file "
            "offline store sorts times as pandas' nanoseconds, which run from 1677-09-21 to 2262-04-11: over more "
            "than one file its materialize stops on a time outside them (OutOfBoundsDatetime), as may historical "
            "retrieval") in capsys.readouterr().err
    assert cli.main(argv + ["--offline-store", "duckdb"]) == 0  # another store: not ours to say
    assert "pandas" not in capsys.readouterr().err
    _rows(tmp_path / "f", spec, [datetime(2262, 4, 11, tzinfo=timezone.utc)], "tokens-00000-of-00002.parquet")
    assert cli.main(argv) == 0
    assert "pandas" not in capsys.readouterr().err
    import pandas as pd

    from elmo_pipeline.feast.repo import _PANDAS_TIMES

    assert _PANDAS_TIMES == (pd.Timestamp.min.ceil("us").to_pydatetime().replace(tzinfo=timezone.utc),
                             pd.Timestamp.max.floor("us").to_pydatetime().replace(tzinfo=timezone.utc))


@pytest.mark.filterwarnings("ignore::FutureWarning:dask")
def test_times_of_a_file_without_statistics_are_read(tmp_path, capsys, feast_import_isolation):
    """A shard rewritten without Parquet statistics (another tool's, or write_statistics=False) was
    left out of the event times: the printed `feast materialize` range ended with the other
    shard's times, so its tokens, a year later, were never served online (2 of 2), and its null
    times were not counted. Its time column is read."""
    spec = _top_spec()
    folder = tmp_path / "f"
    first = _rows(folder, spec, [datetime(2024, 1, 1, tzinfo=timezone.utc)] * 3, "tokens-00000-of-00002.parquet")
    later = _rows(folder, spec, [datetime(2025, 6, 1, 12, tzinfo=timezone.utc)] * 2, "tokens-00001-of-00002.parquet",
                  doc="e")
    pq.write_table(later, folder / "tokens-00001-of-00002.parquet", write_statistics=False)
    store, run_feast, materialize, _ = _feast_repo(folder, tmp_path / "repo", capsys)
    assert materialize == ["materialize", "2024-01-01T00:00:00", "2025-06-01T12:00:01"]
    run_feast(*materialize)
    both = pa.concat_tables([first, later])
    online = store.get_online_features(features=store.get_feature_service("elmo_vectors"),
                                       entity_rows=[{"token_id": i} for i in both.column("token_id").to_pylist()])
    for got, expected in zip(online.to_dict()["layer_2"], both.column("layer_2").to_pylist()):
        assert got is not None and np.array_equal(_as_f32(got), _as_f32(expected))
    times = later.column("event_timestamp").to_pylist()
    pq.write_table(later.set_column(later.schema.get_field_index("event_timestamp"), "event_timestamp",
                                    pa.array([times[0], None], later.schema.field("event_timestamp").type)),
                   folder / "tokens-00001-of-00002.parquet", write_statistics=False)
    files = inspect_features(str(folder))
    assert files.null_timestamps == 1
    assert (files.min_timestamp, files.max_timestamp) == (datetime(2024, 1, 1, tzinfo=timezone.utc), times[0])


@pytest.mark.filterwarnings("ignore::FutureWarning:dask")
def test_the_ttl_comment_says_what_feast_does_with_it(tmp_path, capsys, feast_import_isolation):
    """The comment beside ttl= said that a vector is not served once its event time is older than
    the TTL; Feast 0.67 applies the TTL to historical retrieval only: with --ttl 1h and times of
    2024, get_online_features served all 3 vectors after materialize."""
    import pandas as pd

    spec = _top_spec()
    when = datetime(2024, 1, 1, tzinfo=timezone.utc)
    table = _rows(tmp_path / "f", spec, [when] * 3)
    store, run_feast, materialize, _ = _feast_repo(tmp_path / "f", tmp_path / "repo", capsys, "--ttl", "1h")
    (line,) = [line for line in (tmp_path / "repo" / "features.py").read_text().splitlines() if "ttl=" in line]
    assert line.endswith("# 1h: historical retrieval leaves out a vector older than this at the entity row's time; "
                         "online, Feast serves what was materialized, whatever its age")
    ids = table.column("token_id").to_pylist()
    service = store.get_feature_service("elmo_vectors")
    for at, kept in ((when + timedelta(minutes=30), [True] * 3), (when + timedelta(hours=2), [False] * 3)):
        history = store.get_historical_features(
            entity_df=pd.DataFrame({"token_id": ids, "event_timestamp": [at] * 3}), features=service).to_df()
        got = dict(zip(history["token_id"], history["layer_2"]))
        assert [isinstance(got.get(i), (list, np.ndarray)) for i in ids] == kept, at
    run_feast(*materialize)
    online = store.get_online_features(features=service, entity_rows=[{"token_id": i} for i in ids]).to_dict()
    for got, expected in zip(online["layer_2"], table.column("layer_2").to_pylist()):
        assert np.array_equal(_as_f32(got), _as_f32(expected))


@pytest.mark.filterwarnings("ignore::FutureWarning:dask")
def test_store_settings_past_the_basic_plane_are_written_as_yaml_reads_them(tmp_path, capsys,
                                                                             feast_import_isolation):
    """A setting holding a character past U+FFFF (a registry or SQLite path with CJK Extension B
    in it) was written as JSON's surrogate pair, which YAML reads as two lone surrogates: `feast
    apply` failed with 'UnicodeEncodeError: surrogates not allowed'. It is written as YAML's own
    escape (every character past ASCII is)."""
    spec = _top_spec()
    _rows(tmp_path / "f", spec, [datetime(2024, 1, 1, tzinfo=timezone.utc)])
    repo = tmp_path / "repo"
    registry, online = "data/reg\U00020000.db", "data/on\U0001F600.db"
    _, run_feast, materialize, _ = _feast_repo(tmp_path / "f", repo, capsys, "--registry", registry,
                                               "--online-path", online)
    config = yaml.safe_load((repo / "feature_store.yaml").read_text(encoding="utf-8"))
    assert (config["registry"], config["online_store"]["path"]) == (registry, online)
    run_feast(*materialize)
    assert (repo / registry).is_file() and (repo / online).is_file()
    other = {"x": "a\x7f\u00e9\u2028\U0001F600", "y": ["\\ud83d\\ude00"]}  # the last: backslashes, no escape
    write_repo(str(tmp_path / "f"), str(tmp_path / "repo2"), RepoOptions(offline_options=other))
    config = yaml.safe_load((tmp_path / "repo2" / "feature_store.yaml").read_text(encoding="utf-8"))
    assert config["offline_store"] == {"type": "file", **other}


def test_a_glob_or_file_of_a_run_that_failed_its_checks_is_served_with_a_warning(tmp_path, capsys):
    """The checks of a run's summary.json were asked for a folder only: `--features
    run/tokens-*.parquet` (the FileSource's own pattern) or one shard of a run whose summary.json
    says vectors_finite: false was served without a word. A glob or file within one folder has
    that folder's run asked whether it failed; which of its shards, and so how many rows, are the
    user's choice."""
    spec = _top_spec()
    folder = tmp_path / "run"
    for shard in range(2):
        _rows(folder, spec, [datetime(2024, 1, 1, tzinfo=timezone.utc)], f"tokens-0000{shard}-of-00002.parquet",
              doc=f"d{shard}")
    (folder / "summary.json").write_text(json.dumps({"vectors_finite": False, "ids_unique": True,
                                                     "rows_in_files": 2}))
    repos = iter(range(10))

    def serve(features: Path) -> str:
        """feast-repo into a repository of its own; what it printed"""
        assert cli.main(["feast-repo", "--output", str(tmp_path / f"repo{next(repos)}"), "--features",
                         str(features)]) == 0
        return capsys.readouterr().err

    says = f"warning: {folder / 'summary.json'} says vectors_finite: false: the run that wrote these features failed"
    for features in (folder / "tokens-*.parquet", folder / "tokens-00001-of-00002.parquet", folder):
        err = serve(features)
        assert says in err, features
        assert "rows, and the files hold" not in err and "missing" not in err  # one shard of two: chosen
    (folder / "summary.json").write_text(json.dumps({"vectors_finite": True, "rows_in_files": 2}))
    assert "warning" not in serve(folder / "tokens-00001-of-00002.parquet")
    (folder / "summary.json").unlink()  # a glob of the user's own files: no run to ask
    assert "warning" not in serve(folder / "tokens-*.parquet")


def test_event_times_without_a_time_zone_are_warned_of_not_a_traceback(tmp_path, capsys):
    """A shard rewritten by another tool with a timestamp column without a time zone (extract
    writes UTC) stopped feast-repo with 'TypeError: can't compare offset-naive and offset-aware
    datetimes' after it had written the repository: its pandas range check compared them with
    aware bounds. Over more than one file Feast 0.67's file offline store cannot use such times
    (historical retrieval stopped on a TypeError), which is said instead."""
    spec = _top_spec()
    table = _rows(tmp_path / "f", spec, [datetime(2024, 1, 1, tzinfo=timezone.utc), datetime(2024, 2, 1, 6)])
    column = table.schema.get_field_index("event_timestamp")
    naive = table.set_column(column, "event_timestamp", table.column(column).cast(pa.timestamp("us")))
    pq.write_table(naive.replace_schema_metadata(table.schema.metadata),
                   tmp_path / "f" / "tokens-00000-of-00001.parquet")
    argv = ["feast-repo", "--features", str(tmp_path / "f"), "--output", str(tmp_path / "repo"), "--overwrite"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert (f"warning: {tmp_path / 'f' / 'tokens-*.parquet'}: its event_timestamp is timestamp[us], without a time "
            "zone, which Feast's file offline store cannot compare with its own UTC times: over more than one file "
            "its historical retrieval stops") in err
    assert "feast materialize 2024-01-01T00:00:00 2024-02-01T06:00:01" in err
    assert cli.main(argv + ["--offline-store", "duckdb"]) == 0  # another store: not ours to say
    assert "time zone" not in capsys.readouterr().err


def test_a_repository_rewritten_over_the_same_run_moved_says_nothing(tmp_path, capsys):
    """--overwrite over a repository that served the same extract run from another path (the run's
    folder copied or moved, or reached through a link) warned that the online store would serve
    other features' vectors: they are that run's own. The run is told by its `started`; another
    run there still warns."""
    spec = _top_spec(started="2026-01-01T10:00:00Z")
    _one_run(tmp_path / "a", spec, 3)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    argv = ["feast-repo", "--output", str(tmp_path / "repo"), "--overwrite", "--features"]
    assert cli.main([*argv, str(tmp_path / "a")]) == 0
    capsys.readouterr()
    for features in ("copy", "link", "a"):
        assert cli.main([*argv, str(tmp_path / features)]) == 0
        assert "warning" not in capsys.readouterr().err, features
    other = _top_spec(started="2026-01-02T10:00:00Z")
    _one_run(tmp_path / "b", other, 3)
    assert cli.main([*argv, str(tmp_path / "b")]) == 0
    assert (f"served {tmp_path / 'a'}/tokens-*.parquet (extract started 2026-01-01T10:00:00Z) under the feature view "
            "elmo_tokens") in capsys.readouterr().err


_THREADS_STARTED = """
import os, sys
from elmo_pipeline.cli.main import main
threads = len(os.listdir("/proc/self/task"))
assert main(sys.argv[1:]) == 0
print(len(os.listdir("/proc/self/task")) - threads)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
def test_an_empty_row_group_has_no_time_column_to_read(tmp_path):
    """pyarrow writes an empty table as one row group of 0 rows without statistics, and feast-repo
    read such a file's time column with pq.read_table, which starts Arrow's thread pools (2 threads
    more): a feast-repo ended by Ctrl-C or SIGTERM with them running aborted now and then at exit
    ('terminate called without an active exception', 2 of 50 runs of the signal test's command).
    An empty row group has nothing to count; the other shard's times are the range."""
    spec = _top_spec()
    folder = _write(tmp_path / "f", spec, "tokens-00000-of-00002.parquet")
    assert pq.read_metadata(folder / "tokens-00000-of-00002.parquet").row_group(0).num_rows == 0
    _rows(folder, spec, [datetime(2024, 1, 1, tzinfo=timezone.utc), datetime(2024, 3, 1, tzinfo=timezone.utc)],
          "tokens-00001-of-00002.parquet")
    run = subprocess.run([sys.executable, "-c", _THREADS_STARTED, "feast-repo", "--features", str(folder),
                          "--output", str(tmp_path / "repo")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "0\n"
    assert "feast materialize 2024-01-01T00:00:00 2024-03-01T00:00:01" in run.stderr
    assert "hold no rows" not in run.stderr  # an empty shard beside one with rows serves tokens


def test_a_features_url_is_written_without_its_password(tmp_path, capsys):
    """features.py named --features as given: http://user:pw@host/out/ wrote the password into the
    FileSource's path, in a file a repository keeps and shares. It is named without the user part,
    with a warning that Feast then reads it without them."""
    from support import HttpServer

    _write(tmp_path / "out", OutputSpec(n_layers=3, width=8, dtype="float32", with_timestamp=True))
    server = HttpServer(tmp_path)
    try:
        given = server.url.replace("://", "://user:pw-7Hq@", 1) + "/ok/out/tokens-00000-of-00001.parquet"
        assert cli.main(["feast-repo", "--features", given, "--output", str(tmp_path / "repo")]) == 0
        shown = f"{server.url}/ok/out/tokens-00000-of-00001.parquet"
        written = "".join(p.read_text(encoding="utf-8") for p in (tmp_path / "repo").rglob("*") if p.is_file())
        assert f"path={shown!r}," in written and [s for s in ("user:", "pw-7Hq") if s in written] == []
        assert (f"warning: {shown}: features.py names it without the user and password of --features, so Feast "
                "reads it without them") in capsys.readouterr().err
    finally:
        server.close()
