"""Security: nothing loaded from a path or URL is unpickled; configs are parsed strictly; HDF5
weight files can only read their own bytes; ids and tokens from the data never become paths.

Beside tests/formats/test_checkpoints.py (an unknown field, an ill-typed options.json field, an
external link on a tensor), which this file extends.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import elmo_pipeline
from elmo_pipeline import BiLM
from elmo_pipeline.cli.main import main as cli_main
from elmo_pipeline.formats.files import CheckpointError
from elmo_pipeline.formats.shapes import _native_dims, check_config_against_shapes
from elmo_pipeline.strict import ConfigError
from elmo_pipeline.pipelines.extract import run
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.model.scalar_mix import load_mix_specs
from elmo_pipeline.training import checkpointing as ckpt
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.trainer import train
from elmo_pipeline.model.vocabulary import Vocabulary
from support import MODEL_KINDS, data_path, parse_extract_args, pickle_bomb, small_model_config


@pytest.fixture
def native_model(tmp_path, reference_model) -> Path:
    reference_model.save_pretrained(str(tmp_path / "model"))
    return tmp_path / "model"


def test_the_payload_is_live_when_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    torch.load(pickle_bomb(tmp_path / "bomb.pt", marker), weights_only=False)
    assert marker.exists()  # so its absence below means: never unpickled


@pytest.mark.parametrize("target", ["model.safetensors", "config.json"])
def test_a_pickle_as_a_native_model_file_is_refused_unread(tmp_path, native_model, target):
    marker = tmp_path / "pwned"
    pickle_bomb(native_model / target, marker)
    with pytest.raises(CheckpointError, match=re.escape(str(native_model / target))):
        BiLM.from_pretrained(str(native_model))
    config = json.loads((native_model / "config.json").read_text()) if target != "config.json" else None
    if config:  # without the checksum the safetensors parser refuses it itself
        del config["weights_sha256"]
        (native_model / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
            BiLM.from_pretrained(str(native_model))
    assert not marker.exists()


@pytest.mark.parametrize("target", ["weights", "options"])
def test_a_pickle_as_an_original_model_file_is_refused_unread(tmp_path, elmo_fixture_dir, target):
    marker = tmp_path / "pwned"
    options, weights = elmo_fixture_dir / "options.json", elmo_fixture_dir / "lm_weights.hdf5"
    bomb = pickle_bomb(tmp_path / ("w.hdf5" if target == "weights" else "options.json"), marker)
    pair = f"{options},{bomb}" if target == "weights" else f"{bomb},{weights}"
    with pytest.raises((CheckpointError, ConfigError), match=re.escape(str(bomb))):
        BiLM.load(pair)
    assert not marker.exists()


def test_a_pickle_as_a_vocabulary_or_mix_file_is_refused_unread(tmp_path):
    marker = tmp_path / "pwned"
    bomb = pickle_bomb(tmp_path / "vocab.json", marker).read_bytes()
    with pytest.raises(ConfigError, match="vocab.json: not valid JSON"):
        Vocabulary.from_json(bomb, "vocab.json")
    with pytest.raises(ConfigError, match="mixes.json: not valid JSON"):
        load_mix_specs(bomb, "mixes.json")
    assert not marker.exists()


def test_a_pickle_in_a_training_checkpoint_is_refused_unread(tmp_path):
    lines = [line for line in data_path("wikitext2", "wiki.valid.tokens").read_text(encoding="utf-8")
             .splitlines(keepends=True)[:60] if line.strip()]
    prepare_in_process(whitespace_sentences(Document("d", "".join(lines), "d", 1), 40), str(tmp_path / "data"),
                       tokenizer="whitespace", lang="en", max_sentence_tokens=40, unk_alias="<unk>",
                       shard_tokens=10**6)
    args = dict(data=str(tmp_path / "data"), output=str(tmp_path / "run"), preset="tiny", epochs=5, batch_tokens=300,
                checkpoint_every=1, log_every=100, threads=1)
    train(TrainArgs(max_steps=2, **args))
    latest = Path(ckpt.latest_checkpoint(str(tmp_path / "run")))
    marker = tmp_path / "pwned"
    for name in ("optimizer.safetensors", "rng-rank00000.safetensors"):
        original = (latest / name).read_bytes()
        pickle_bomb(latest / name, marker)
        with pytest.raises(Exception, match="(?i)header|deserializ|safetensor"):
            train(TrainArgs(max_steps=4, **args))  # resumes from the tampered checkpoint
        (latest / name).write_bytes(original)
    assert not marker.exists()


def test_the_package_source_has_no_unpickling_loader():
    # A backstop only (the tests above are the proof): no loader that unpickles appears in the package.
    root = Path(elmo_pipeline.__file__).resolve().parents[1]
    banned = re.compile(r"\b(pickle\.loads?|torch\.load|joblib\.load|dill\.|cloudpickle\.loads?|marshal\.loads?|"
                        r"shelve\.open|yaml\.load|yaml\.unsafe_load)\s*\(|"
                        r"allow_pickle\s*=\s*True|weights_only\s*=\s*False")
    sources = [p for folder in ("elmo_pipeline", "transforms", "pipelines") for p in (root / folder).rglob("*.py")]
    assert len(sources) > 20
    # The one exception: ELMoForManyLangs weights are pickles, read from bytes in memory by torch's
    # restricted unpickler only (tests/formats/test_formanylangs.py holds a live payload to it), its
    # storages first onto the meta device (map_location), where their sizes are checked.
    sanctioned = re.compile(r"torch\.load\(io\.BytesIO\(data\), weights_only=True(, map_location=location)?\)")
    found, allowed = [], []
    for p in sources:
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if sanctioned.search(line) and p.relative_to(root).as_posix() == "elmo_pipeline/formats/formanylangs.py":
                allowed.append(f"{p}:{i}")
            elif banned.search(line):
                found.append(f"{p}:{i}")
    assert found == []
    assert len(allowed) == 1


# -- strict configs -----------------------------------------------------------------------------
def _set(path: str, value):
    def edit(config: dict) -> None:
        *parents, key = path.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[key] = value
    return edit


def _drop(path: str):
    def edit(config: dict) -> None:
        *parents, key = path.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        del node[key]
    return edit


CONFIG_CASES = {  # edit of config.json -> what the error names
    "unknown top-level field": (_set("dropout", 0.1), r"unknown field\(s\) \['dropout'\]"),
    "unknown lstm field": (_set("lstm.hidden", 4), r"lstm: unknown field\(s\) \['hidden'\]"),
    "unknown char_cnn field": (_set("char_cnn.kernel", 3), r"char_cnn: unknown field\(s\) \['kernel'\]"),
    "unknown embedding field": (_set("char_cnn.embedding.size", 3), r"char_cnn\.embedding: unknown field"),
    "unknown softmax field": (_set("softmax.temperature", 2), r"softmax: unknown field\(s\) \['temperature'\]"),
    "bool for an integer": (_set("lstm.dim", True), r"lstm\.dim: expected an integer, got True"),
    "float for an integer": (_set("lstm.projection_dim", 16.0), r"lstm\.projection_dim: expected an integer"),
    "string for an integer": (_set("char_cnn.n_highway", "1"), r"char_cnn\.n_highway: expected an integer"),
    "zero size": (_set("lstm.n_layers", 0), r"lstm\.n_layers: must be >= 1"),
    "string for a clip": (_set("lstm.cell_clip", "3"), r"lstm\.cell_clip: expected a number or null"),
    "negative clip": (_set("lstm.proj_clip", -3), r"lstm\.proj_clip: a clip must be positive"),
    "string for a bool": (_set("lstm.use_skip_connections", "true"), r"use_skip_connections: expected true or false"),
    "bad filter": (_set("char_cnn.filters", [[1, 4], [2]]), r"char_cnn\.filters\[1\]: expected \[width, count\]"),
    "unknown activation": (_set("char_cnn.activation", "gelu"), r"char_cnn\.activation: expected one of"),
    "unknown encoder": (_set("token_encoder", "bpe"), r"token_encoder: expected one of"),
    "null name": (_set("name", None), r"name: expected a string"),
    "missing lstm": (_drop("lstm"), r"missing field\(s\) \['lstm'\]"),
    "other format": (_set("format", "allennlp"), r"format 'allennlp' is not 'elmo-pipeline'"),
    "future version": (_set("format_version", 2), r"format_version 2 is not supported"),
    "checksum not hex": (_set("weights_sha256", "x" * 64), r"weights_sha256: expected 64 lowercase hex digits"),
    "checksum not a string": (_set("weights_sha256", 7), r"weights_sha256: expected 64 lowercase hex digits"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_fields_are_parsed_strictly_and_errors_name_the_file(native_model, case):
    edit, message = CONFIG_CASES[case]
    path = native_model / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as caught:
        BiLM.from_pretrained(str(native_model))
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("text, message", [
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"lstm": NaN}', "NaN is not valid JSON"),
    ('{"lstm": Infinity}', "Infinity is not valid JSON"),
    ('{"lstm": {"cell_clip": 1e999}}', "lstm.cell_clip (inf) is not a finite number: '1e999' is beyond the range"),
    ('{"softmax": {"div_value": -1e400}}', "softmax.div_value (-inf) is not a finite number: '-1e400'"),
    ('{"lstm": {"dim": ' + "7" * 5000 + "}}", "not valid JSON (Exceeds the limit (4300 digits) for integer string "
                                              "conversion: value has 5000 digits)"),
    ("[" * 100_000, "not valid JSON (nested too deeply to parse)"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("{", "not valid JSON"),
])
def test_config_json_syntax_is_strict(native_model, text, message):
    (native_model / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(f"{native_model / 'config.json'}: ") + ".*" + re.escape(message)):
        BiLM.from_pretrained(str(native_model))


@pytest.mark.parametrize("edit, message", [
    (lambda o: o.update(dropout_rate=0.1), r"options\.json: unknown field\(s\) \['dropout_rate'\]"),
    (lambda o: o["lstm"].update(dim="4096"), r"lstm\.dim: expected an integer"),
    (lambda o: o["char_cnn"].update(n_characters=300), r"char_cnn\.n_characters: expected 261 or 262"),
    (lambda o: o["char_cnn"].update(filters=[[60, 4]]), r"char_cnn\.filters: width 60 exceeds"),
    (lambda o: o["lstm"].update(cell_clip=math.inf), r"lstm\.cell_clip \(inf\) is not a finite number: '1e999'"),
])
def test_original_options_are_parsed_strictly(tmp_path, elmo_fixture_dir, edit, message):
    options = json.loads((elmo_fixture_dir / "options.json").read_text())
    edit(options)
    # json.dumps writes an infinity as Infinity, which is refused as such; 1e999 is what reads as one
    (tmp_path / "options.json").write_text(json.dumps(options).replace("Infinity", "1e999"))
    with pytest.raises(ConfigError, match=message) as caught:
        BiLM.load(f"{tmp_path / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}")
    assert str(caught.value).startswith(f"{tmp_path / 'options.json'}: ")


@pytest.mark.parametrize("text, message", [
    ('{"m": {"weights": [1, 2, 3], "gama": 1}}',
     "expected 'weights' with optional 'gamma', 'layer_norm' and 'layers_sha256'"),
    ('{"m": {"weights": [1, 2, 3], "layers_sha256": "ABC"}}', "m.layers_sha256: expected 64 lowercase hex digits"),
    ('{"m": {"weights": [1, "2", 3]}}', "m.weights: expected a non-empty list of finite numbers"),
    ('{"m": {"weights": [1, 2, 3], "layer_norm": 1}}', "m.layer_norm: expected true or false"),
    ('{"m": {"weights": [1, 2, 3], "gamma": true}}', "m.gamma: expected a finite number"),
])
def test_mix_files_are_parsed_strictly(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_mix_specs(text, "mixes.json")


# -- a config that does not match its tensors: refused before the model is allocated -------------
# Each case asks for far more memory than the machine has (24 GiB) beside unchanged tensors. The
# loads run in a child process limited to 3 GiB of address space beyond what its imports mapped
# (a CUDA build of torch maps about 3 GiB on import), so that a regression (the model allocated
# before its tensors are compared) fails the test instead of taking the machine down.
_HOSTILE_NATIVE = {  # edit of config.json -> the field and the tensor the refusal must name
    "lstm.dim": (_set("lstm.dim", 50_000_000), "lstm.dim=50000000", "'lstm.layers.0.input_weight'"),
    "lstm.n_layers": (_set("lstm.n_layers", 1_000_000), "lstm.n_layers=1000000", "'lstm.layers.N.*'"),
    "char_cnn.filters": (_set("char_cnn.filters", [[1, 4], [2, 8], [3, 16], [4, 32], [5, 100_000_000]]),
                         "char_cnn.filters[4]=[5, 100000000]", "'token_encoder.char_cnn.convs.4.weight'"),
}
_HOSTILE_DEFAULT = {  # the same, on the default model (word embedding and adaptive softmax)
    "word_embedding_dim": (_set("word_embedding_dim", 10_000_000), "word_embedding_dim=10000000",
                           "'token_encoder.word_embedding.weight'"),
    "lstm.projection_dim": (_set("lstm.projection_dim", 4_000_000), "lstm.projection_dim=4000000",
                            "'token_encoder.projection.weight'"),
}
_HOSTILE_OPTIONS = {  # edit of options.json (the original format)
    "lstm.dim": (lambda o: o["lstm"].update(dim=50_000_000), "lstm.dim=50000000",
                 "'RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0'"),
    "char_cnn.embedding.dim": (lambda o: o["char_cnn"]["embedding"].update(dim=100_000_000),
                               "char_cnn.embedding.dim=100000000", "'char_embed'"),
    "char_cnn.n_highway": (lambda o: o["char_cnn"].update(n_highway=1_000_000), "char_cnn.n_highway=1000000",
                           "'CNN_high_2/W_carry'"),
}

_LOAD_UNDER_LIMIT = """
import json, resource, sys
from elmo_pipeline import BiLM
mapped = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 30),) * 2)
results = {}
for case, location in json.loads(sys.argv[1]).items():
    try:
        BiLM.load(location)
        results[case] = ["loaded", ""]
    except Exception as exc:
        results[case] = [type(exc).__name__, str(exc)]
print(json.dumps(results))
"""


def _copy_default_model(folder: Path) -> Path:
    """A writable copy of the embedded default model's files, for tests that edit its config."""
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "vocab.json"):
        (folder / name).write_bytes((Path(elmo_pipeline.__file__).parent / "default_model" / name).read_bytes())
    return folder


def test_configs_asking_for_more_memory_than_the_machine_has_are_refused_by_field_and_tensor(
        tmp_path, native_model, elmo_fixture_dir):
    default = _copy_default_model(tmp_path / "default")
    locations, expected = {}, {}
    for cases, source in ((_HOSTILE_NATIVE, native_model), (_HOSTILE_DEFAULT, default)):
        for case, (edit, field, tensor) in cases.items():
            folder = tmp_path / f"{source.name}-{case}"
            folder.mkdir()
            for path in source.iterdir():
                (folder / path.name).write_bytes(path.read_bytes())
            config = json.loads((folder / "config.json").read_text())
            edit(config)  # weights_sha256 still matches: it covers the weights, not the config
            (folder / "config.json").write_text(json.dumps(config))
            locations[f"native {source.name} {case}"] = str(folder)
            expected[f"native {source.name} {case}"] = (field, tensor, "model.safetensors")
    for case, (edit, field, tensor) in _HOSTILE_OPTIONS.items():
        options = json.loads((elmo_fixture_dir / "options.json").read_text())
        edit(options)
        path = tmp_path / f"options-{case}.json"
        path.write_text(json.dumps(options))
        locations[f"original {case}"] = f"{path},{elmo_fixture_dir / 'lm_weights.hdf5'}"
        expected[f"original {case}"] = (field, tensor, "lm_weights.hdf5")
    child = subprocess.run([sys.executable, "-c", _LOAD_UNDER_LIMIT, json.dumps(locations)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    for case, (field, tensor, weights) in expected.items():
        kind, message = results[case]
        assert kind == "CheckpointError", (case, kind, message)
        assert field in message and tensor in message and weights in message, (case, message)


def _unwritten_lstm_bomb(elmo_fixture_dir: Path, folder: Path, dim: int) -> tuple[Path, Path]:
    """options.json with lstm.dim `dim` (one layer) beside an HDF5 file whose LSTM datasets have that
    shape but were never written: chunked and compressed, they cost nothing on disk."""
    options = json.loads((elmo_fixture_dir / "options.json").read_text())
    options["lstm"].update(dim=dim, n_layers=1)
    (folder / "options.json").write_text(json.dumps(options))
    with h5py.File(elmo_fixture_dir / "lm_weights.hdf5", "r") as src, h5py.File(folder / "w.hdf5", "w") as f:
        for name in ("char_embed", "CNN", "CNN_high_0", "CNN_high_1", "CNN_proj"):
            src.copy(name, f)
        for direction in (0, 1):
            base = f"RNN_{direction}/RNN/MultiRNNCell/Cell0/LSTMCell"
            f.create_dataset(f"{base}/W_0", shape=(32, 4 * dim), dtype="f4", chunks=(32, 1 << 16), compression="gzip")
            f.create_dataset(f"{base}/B", shape=(4 * dim,), dtype="f4", chunks=(1 << 20,), compression="gzip")
            f.create_dataset(f"{base}/W_P_0", shape=(dim, 16), dtype="f4", chunks=(1 << 16, 16), compression="gzip")
    return folder / "options.json", folder / "w.hdf5"


def test_files_that_would_fill_memory_are_refused_before_they_are_read(tmp_path, native_model, elmo_fixture_dir):
    # under the address-space limit of the test above: a weights file that is /dev/zero (through a symbolic
    # link) or a FIFO (which would block), an options.json that is /dev/zero, and an HDF5 file of a few hundred
    # KB whose datasets declare 5 GB (the original format's import took 18.6 GB of memory for it)
    locations, expected = {}, {}
    for case, make in (("devzero", lambda path: path.symlink_to("/dev/zero")), ("fifo", os.mkfifo)):
        folder = tmp_path / case
        folder.mkdir()
        for path in native_model.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
        (folder / "model.safetensors").unlink()
        make(folder / "model.safetensors")
        locations[case] = str(folder)
        expected[case] = f"{folder / 'model.safetensors'}: not a regular file (a device, FIFO or socket); refused unread"
        # the same file behind a cache of the local file system: it used to be read (4.4 GB, then a traceback;
        # the FIFO waited for ever)
        locations[f"{case} behind simplecache"] = f"simplecache::file://{folder}"
        expected[f"{case} behind simplecache"] = (f"simplecache::file://{folder}/model.safetensors: not a regular file "
                                                 "(a device, FIFO or socket); refused unread")
    (tmp_path / "options.json").symlink_to("/dev/zero")
    locations["options devzero"] = f"{tmp_path / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    expected["options devzero"] = f"{tmp_path / 'options.json'}: not a regular file"
    (tmp_path / "bomb").mkdir()
    options, weights = _unwritten_lstm_bomb(elmo_fixture_dir, tmp_path / "bomb", 1 << 22)
    assert weights.stat().st_size < 1_000_000
    locations["hdf5 bomb"] = f"{options},{weights}"
    expected["hdf5 bomb"] = (f"{weights}: its datasets declare 4,966,324,864 bytes, more than the 4,294,967,296 a "
                             "weight file may hold; refused before reading")
    child = subprocess.run([sys.executable, "-c", _LOAD_UNDER_LIMIT, json.dumps(locations)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    for case, message in expected.items():
        assert results[case][0] in ("CheckpointError", "ConfigError") and message in results[case][1], (case, results[case])


@pytest.mark.parametrize("special", ["devzero", "fifo"])
def test_files_of_lines_that_are_devices_or_fifos_are_refused_unread(tmp_path, capsys, special, model_arg):
    # similarity --file, embed-file and probe read a file of lines whole: /dev/zero's first line
    # (it has no line end) filled memory, and a FIFO would block
    lines = tmp_path / "lines.txt"
    lines.symlink_to("/dev/zero") if special == "devzero" else os.mkfifo(lines)
    for argv in (["similarity", "--word", "a", "--file", str(lines), "--model", model_arg],
                 ["embed-file", str(lines), str(tmp_path / "out.h5"), "--model", model_arg],
                 ["probe", "--train", str(lines), "--dev", str(lines), "--output", str(tmp_path / "probe"),
                  "--model", model_arg]):
        assert cli_main(argv) == 2, argv
        said = f"{lines}: not a regular file (a device, FIFO or socket); refused unread"
        assert said in capsys.readouterr().err, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lines.txt"]  # nothing written


def test_a_softmax_config_that_does_not_match_its_tensors_names_the_field(tmp_path):
    folder = _copy_default_model(tmp_path / "default")
    config = json.loads((folder / "config.json").read_text())
    config["softmax"]["cutoffs"] = [3000, 10000]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor 'softmax\.adaptive\.head\.weight' has shape \(2002, 128\), "
                                              r"but softmax\.cutoffs=\[3000, 10000\].* needs \(3002, 128\)"):
        BiLM.from_pretrained(str(folder))


@pytest.mark.parametrize("encoder, softmax", MODEL_KINDS)
def test_every_kind_of_model_matches_its_own_tensors(encoder, softmax):
    config, words = small_model_config(encoder, softmax)
    shapes = {k: tuple(v.shape) for k, v in BiLM(config, words).state_dict().items()}
    check_config_against_shapes(BiLM, config, words, shapes, "w", "c")  # no false refusal
    for name, shape in shapes.items():  # and every axis a config field sets names that field
        dims = _native_dims(name, shape, config)
        fixed = (0,) if name.startswith("lstm.") or name.endswith("char_embedding.weight") else ()
        assert [d.size for d in dims] == list(shape)
        assert all(d.field for i, d in enumerate(dims) if i not in fixed), (name, dims)


# -- HDF5: a weight file reads only its own bytes -----------------------------------------------
def _copy_weights_with(src: Path, dst: Path, replace: str, make) -> None:
    names = []
    with h5py.File(src, "r") as f:
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        with h5py.File(dst, "w") as out:
            for name in names:
                if name != replace and not name.startswith(replace + "/"):
                    out.create_dataset(name, data=f[name][...])
            make(out, f)


def _virtual(out, f):
    data = f["CNN_proj/W_proj"][...]
    with h5py.File(Path(out.filename).with_name("source.h5"), "w") as source:
        source.create_dataset("d", data=data)
    layout = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
    layout[...] = h5py.VirtualSource(str(Path(out.filename).with_name("source.h5")), "d", shape=data.shape)
    out.create_virtual_dataset("CNN_proj/W_proj", layout)


def _external_storage(out, f):
    data = f["CNN_proj/W_proj"][...]
    raw = Path(out.filename).with_name("raw.bin")
    raw.write_bytes(data.astype(np.float32).tobytes())
    out.create_dataset("CNN_proj/W_proj", shape=data.shape, dtype=np.float32, external=[(str(raw), 0, data.nbytes)])


def _external_group(out, f):
    with h5py.File(Path(out.filename).with_name("outside.h5"), "w") as outside:
        for name in f["CNN"]:
            outside.create_dataset(f"CNN/{name}", data=f[f"CNN/{name}"][...])
    out["CNN"] = h5py.ExternalLink(str(Path(out.filename).with_name("outside.h5")), "/CNN")


def _soft_link(out, f):
    out.create_dataset("elsewhere", data=f["CNN_proj/W_proj"][...])
    out["CNN_proj/W_proj"] = h5py.SoftLink("/elsewhere")


@pytest.mark.parametrize("make, replace, message", [
    (_virtual, "CNN_proj/W_proj", r"tensor 'CNN_proj/W_proj' points outside the file \(virtual or external\)"),
    (_external_storage, "CNN_proj/W_proj", r"tensor 'CNN_proj/W_proj' points outside the file"),
    (_external_group, "CNN", r"group 'CNN' of tensor 'CNN/W_cnn_0' is a ExternalLink; only plain datasets"),
    (_soft_link, "CNN_proj/W_proj", r"tensor 'CNN_proj/W_proj' is a SoftLink; only plain datasets"),
], ids=["virtual dataset", "external storage", "external link on a group", "soft link"])
def test_hdf5_files_that_point_elsewhere_are_refused(tmp_path, elmo_fixture_dir, make, replace, message):
    weights = tmp_path / "w.hdf5"
    _copy_weights_with(elmo_fixture_dir / "lm_weights.hdf5", weights, replace, make)
    with pytest.raises(CheckpointError, match=re.escape(str(weights)) + ": " + message):
        BiLM.load(f"{elmo_fixture_dir / 'options.json'},{weights}")


# -- ids and tokens never become paths ----------------------------------------------------------
HOSTILE_IDS = ["../../etc/passwd", "/abs/path/file", "..", ".", "a/b/c", "~root/.ssh", "C:\\Windows\\system32",
               "tokens-00000-of-00001.parquet", "summary.json", "$(touch pwned)", "`touch pwned`", "%2e%2e%2fx",
               "id\twith\ttabs", "🙂/../🙂", "x" * 5000, 12345]


def test_hostile_ids_and_tokens_stay_data(tmp_path, elmo_fixture_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path made from an id would land here
    records = [{"id": doc_id, "text": f"Token ../../x and /etc/passwd here. Doc {i} ends."}
               for i, doc_id in enumerate(HOSTILE_IDS)]
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    out = tmp_path / "out"
    summary = run(*parse_extract_args([
        "--input", str(src), "--output", str(out), "--format", "jsonl", "--id-field", "id", "--num-shards", "2",
        "--model", f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"]))
    assert summary["documents_read"] == len(HOSTILE_IDS) and summary["tokens_reconcile"]
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert sorted(set(after) - set(before)) == [
        "out", "out/errors-00000-of-00001.jsonl", "out/summary.json", "out/tokens-00000-of-00002.parquet",
        "out/tokens-00001-of-00002.parquet"]
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("tokens-*.parquet")))
    assert set(table.column("doc_id").to_pylist()) == {str(i) for i in HOSTILE_IDS}
    rows = table.sort_by([("sentence_index", "ascending"), ("token_index", "ascending")]).to_pylist()
    first = [row["token"] for row in rows if row["doc_id"] == HOSTILE_IDS[0]]
    assert "".join(first) == "".join(records[0]["text"].split())  # path-like tokens are rows like any other
    assert not Path("/abs/path/file").exists()


def test_a_huge_max_characters_per_token_is_refused_before_the_model_is_built(tmp_path):
    # no tensor's shape carries it, so only the config's bound stands between it and the first
    # embed allocating (words, filters, max_characters_per_token) activations
    folder = _copy_default_model(tmp_path / "default")
    config = json.loads((folder / "config.json").read_text())
    config["char_cnn"]["max_characters_per_token"] = 10_000_000
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: char_cnn.max_characters_per_token: must be <= 256, got 10000000"):
        BiLM.from_pretrained(str(folder))
