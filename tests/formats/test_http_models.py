"""Models read over real HTTP (fsspec's HTTP file system and aiohttp) from a server in the test:
the same weights as the local folder, and each way a server fails named with the file and why."""

import pyarrow.parquet as pq
import pytest
import torch

from elmo_pipeline import BiLM, ElmoConfig
from elmo_pipeline.corpus.schema import read_metadata
from elmo_pipeline.formats.files import CheckpointError, read_bytes
from elmo_pipeline.model.config import CharCnnConfig, LstmConfig
from support import HttpServer


def _tiny_model() -> BiLM:
    torch.manual_seed(0)
    cnn = CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 4)), n_highway=1)
    return BiLM(ElmoConfig(lstm=LstmConfig(dim=16, projection_dim=8), char_cnn=cnn)).eval()


@pytest.fixture
def served(tmp_path):
    """(the tiny model, its local folder `m`, the server serving tmp_path)."""
    model = _tiny_model()
    model.save_pretrained(str(tmp_path / "m"))
    server = HttpServer(tmp_path)
    yield model, tmp_path / "m", server
    server.close()


def _same_weights(loaded: BiLM, model: BiLM) -> bool:
    ours, theirs = loaded.state_dict(), model.state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_model_at_an_http_url_loads_the_local_folders_weights(served):
    model, _, server = served
    for url in (f"{server.url}/ok/m", f"{server.url}/ok/m/", f"{server.url}/moved/m", f"{server.url}/ok/x/../m"):
        assert _same_weights(BiLM.from_pretrained(url), model), url


def test_an_http_folders_query_goes_to_each_of_its_files(served):
    """A folder URL with a query (a token, say) was joined as `m?token=t/config.json`: 'file not
    found'. Each file is asked for with the query."""
    model, _, server = served
    assert _same_weights(BiLM.from_pretrained(f"{server.url}/ok/m/?token=t"), model)
    assert {path for method, path in server.requests if method == "GET"} >= {
        "/ok/m/config.json?token=t", "/ok/m/model.safetensors?token=t"}


def test_extract_records_a_model_url_without_its_password_or_token(served, tmp_path):
    """The metadata of every Parquet file held the location as given: a model at
    http://user:pw@host/m/?token=t wrote the password and the token into each file's footer."""
    from elmo_pipeline.pipelines.extract import run
    from support import parse_extract_args

    _, folder, server = served
    url = server.url.replace("://", "://user:pw-7Hq@", 1) + "/ok/m/?token=tok-9Zx#frag-3Kd"
    (tmp_path / "in.txt").write_text("Hello world .\n")
    summary = run(*parse_extract_args(["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out"),
                                       "--model", url, "--dtype", "float32"]))
    assert summary["tokens_reconcile"] and summary["token_rows_written"] == 3
    assert "/ok/m/config.json?token=tok-9Zx" in {path for _, path in server.requests}  # the token still opened it
    shard = tmp_path / "out" / "tokens-00000-of-00001.parquet"
    meta = read_metadata(pq.read_schema(shard))
    assert meta["model"]["location"] == f"{server.url}/ok/m/"
    assert meta["model"]["sha256"] == BiLM.from_pretrained(str(folder)).checksum  # the model, named by its files
    footer = pq.ParquetFile(shard).metadata.metadata[b"elmo_pipeline"]
    assert [secret for secret in (b"user:", b"pw-7Hq", b"tok-9Zx", b"frag-3Kd") if secret in footer] == []


def test_a_model_urls_query_holding_a_comma_is_recorded_without_any_of_it(served, tmp_path):
    """A folder URL's query may hold a comma (a signature, say), and `load` takes the whole URL as
    one folder; the recorded location was cut at every comma, so what followed it was kept:
    .../ok/m/,part-2Wq. The original's OPTIONS.json,WEIGHTS pair is still recorded as two URLs."""
    from elmo_pipeline.formats.files import model_shown
    from elmo_pipeline.pipelines.extract import run
    from support import parse_extract_args

    _, folder, server = served
    (tmp_path / "in.txt").write_text("Hello world .\n")
    summary = run(*parse_extract_args(["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out"),
                                       "--model", f"{server.url}/ok/m/?sig=part-1Kp,part-2Wq"]))
    assert summary["token_rows_written"] == 3
    assert "/ok/m/model.safetensors?sig=part-1Kp,part-2Wq" in {path for _, path in server.requests}
    meta = read_metadata(pq.read_schema(tmp_path / "out" / "tokens-00000-of-00001.parquet"))
    assert meta["model"]["location"] == f"{server.url}/ok/m/"
    assert model_shown(f"{server.url}/o.json,{server.url}/w.hdf5?b=2,3") == f"{server.url}/o.json,{server.url}/w.hdf5"


def test_a_server_failing_a_model_file_is_named_with_the_file_and_why(served, capsys, tmp_path):
    """An HTTP 500 was reported as 'file not found', and a body cut short (the server closing
    half way through the weights) was aiohttp's ClientPayloadError, a traceback from the command."""
    from elmo_pipeline.cli.main import main

    _, _, server = served
    base = f"{server.url}/ok/m"
    for fault, why in ((500, r"/model\.safetensors: cannot be read \(HTTP 500 Internal Server Error\)$"),
                       (403, r"/model\.safetensors: cannot be read \(HTTP 403 Forbidden\)$"),
                       (404, r"/model\.safetensors: file not found$"),
                       ("cut-short", r"/model\.safetensors: cannot be read \(ClientPayloadError: .*Not enough data")):
        server.faults = {"m/model.safetensors": fault}
        with pytest.raises(CheckpointError, match=why) as caught:
            BiLM.from_pretrained(base)
        assert str(caught.value).startswith(f"{base}/model.safetensors: ")
    server.faults = {"m/config.json": 500}
    with pytest.raises(CheckpointError, match=r"/config\.json: cannot be read \(HTTP 500 Internal Server Error\)$"):
        BiLM.from_pretrained(base)
    # the command says so in one line, exit 2, and writes nothing
    server.faults = {"m/model.safetensors": "cut-short"}
    (tmp_path / "in.txt").write_text("Hello world .\n")
    out = tmp_path / "out.hdf5"
    assert main(["embed-file", str(tmp_path / "in.txt"), str(out), "--model", base]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elmo-pipeline embed-file: error: {base}/model.safetensors: cannot be read (Client")
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "m"]


def test_a_remote_file_declaring_more_than_the_limit_is_refused_unread(served):
    """A server declaring 100 GB had 4 GiB + 1 bytes fetched into memory (27 s and 8.7 GB of
    memory from a local server) before the refusal; its Content-Length refuses it unread."""
    _, folder, server = served
    server.faults = {"m/model.safetensors": "declares-100-GB"}
    with pytest.raises(CheckpointError, match=r"model\.safetensors: its 100,000,000,000 bytes are more than the "
                                               r"4,294,967,296 bytes a model file may have; refused unread$"):
        BiLM.from_pretrained(f"{server.url}/ok/m")
    assert ("GET", "/ok/m/model.safetensors") not in server.requests
    # the limit given, against the true size: one byte over is refused before any GET, at it read
    config = (folder / "config.json").read_bytes()
    server.faults, server.requests[:] = {}, []
    url = f"{server.url}/ok/m/config.json"
    with pytest.raises(CheckpointError, match="refused unread"):
        read_bytes(url, limit=len(config) - 1)
    assert [method for method, path in server.requests if path == "/ok/m/config.json"] == ["HEAD"]
    assert read_bytes(url, limit=len(config)) == config


def test_a_silent_server_fails_the_read_and_a_slow_one_is_waited_for(served, monkeypatch):
    """A server that takes the request and never answers held the load for 10 minutes (aiohttp's
    300 s for fsspec's HEAD, then as long for its GET), then said 'file not found'; that 300 s
    was for a request whole, so a model taking longer to download could not be loaded at all. No
    byte for HTTP_READ_TIMEOUT_S fails the read; a file that keeps coming is waited for."""
    from elmo_pipeline import filesystems

    model, _, server = served
    # 1 s: a server thread held up by a loaded machine has 0.8 s beside the pieces' 0.2 s
    monkeypatch.setattr(filesystems, "HTTP_READ_TIMEOUT_S", 1.0)
    server.faults = {"m/model.safetensors": "silent"}
    with pytest.raises(CheckpointError, match=r"/ok/m/model\.safetensors: cannot be read \(SocketTimeoutError: "):
        BiLM.from_pretrained(f"{server.url}/ok/m")
    server.faults = {"m/model.safetensors": "slow"}  # 1.4 s in all, more than the 1 s without a byte
    assert _same_weights(BiLM.from_pretrained(f"{server.url}/ok/m"), model)


def test_a_model_imported_from_urls_with_a_token_is_not_named_by_it(served, tmp_path, elmo_fixture_dir):
    """import-allennlp and import-formanylangs name the model by its weights file, folder or archive,
    and took a URL's query in: .../lm_weights.hdf5?sig=tok-9Zx gave config.json's name
    'lm_weights.hdf5?sig=tok-9Zx' (and a folder URL's '/?sig=...' the name '?sig=...'), which every
    later extract writes into its metadata. The name is the path's, as model_shown records it."""
    import json
    import shutil
    import zipfile

    from elmo_pipeline.cli.main import main
    from support import data_path

    _, _, server = served
    for name in ("options.json", "lm_weights.hdf5"):
        shutil.copy(elmo_fixture_dir / name, tmp_path / name)
    shutil.copytree(data_path("formanylangs", "fixture_small") / "model", tmp_path / "fml")
    with zipfile.ZipFile(tmp_path / "fml.zip", "w") as archive:
        for file in sorted((tmp_path / "fml").iterdir()):
            archive.write(file, file.name)
    url, query = server.url.replace("://", "://user:pw-7Hq@", 1) + "/ok/", "?sig=tok-9Zx"
    commands = [("lm_weights.hdf5", ["import-allennlp", "--options", url + "options.json" + query,
                                     "--weights", url + "lm_weights.hdf5" + query]),
                ("fml", ["import-formanylangs", url + "fml/" + query]),
                ("fml", ["import-formanylangs", url + "fml.zip" + query])]
    for n, (expected, command) in enumerate(commands):
        out = tmp_path / f"out{n}"
        assert main([*command, "--output", str(out)]) == 0
        config = (out / "config.json").read_text(encoding="utf-8")
        assert json.loads(config)["name"] == expected
        assert [secret for secret in ("user:", "pw-7Hq", "tok-9Zx") if secret in config] == []


def test_a_file_url_s_hash_or_question_mark_is_part_of_the_model_s_name(tmp_path, elmo_fixture_dir):
    """7ebfa93 named an imported model by the path as model_shown records it, which leaves out what
    follows a '?' or '#' in any URL: import-formanylangs file:///.../fml#2 was named 'fml' and
    --weights file:///.../w?v3.hdf5 'w', where 83a31d1 named them 'fml#2' and 'w?v3.hdf5', as the
    plain paths are. Only an HTTP URL has a query (a token) to leave out of the name."""
    import json
    import shutil

    from elmo_pipeline.cli.main import main
    from support import data_path

    shutil.copytree(data_path("formanylangs", "fixture_small") / "model", tmp_path / "fml#2")
    shutil.copy(elmo_fixture_dir / "lm_weights.hdf5", tmp_path / "w?v3.hdf5")
    commands = [("fml#2", ["import-formanylangs", f"file://{tmp_path / 'fml#2'}"]),
                ("fml#2", ["import-formanylangs", str(tmp_path / "fml#2")]),
                ("w?v3.hdf5", ["import-allennlp", "--options", str(elmo_fixture_dir / "options.json"),
                               "--weights", f"file://{tmp_path / 'w?v3.hdf5'}"])]
    for n, (expected, command) in enumerate(commands):
        out = tmp_path / f"out{n}"
        assert main([*command, "--output", str(out)]) == 0
        assert json.loads((out / "config.json").read_text(encoding="utf-8"))["name"] == expected
