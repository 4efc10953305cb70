"""ELMoForManyLangs models: parity with the fixture the family's own code made (every layer, every
sentence, the average, any batch size), other shapes of the family against an independent
reference, every refusal, a live pickle payload, archives and URLs, config_path's fallbacks and
the round trip through our format."""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

import fsspec
import h5py
import numpy as np
import pytest
import torch

from elmo_pipeline import BiLM
from elmo_pipeline.cli.main import main
from elmo_pipeline.formats import sources
from elmo_pipeline.formats.files import CheckpointError
from elmo_pipeline.formats.formanylangs import STANDARD_NETWORK_CONFIGS, load_state_dict
from benchmarks.formanylangs_family import network, reference_layers, write_dic, write_model
from support import data_path, pickle_bomb

TOLERANCE = 1e-5
CHARS = list("abcdefghijklmnopqrstuvwxyzTH我爱自然语言处理天气很好。")
WORDS = ["the", "cat", "sat", "我", "爱", "自然", "。", "supercal"]
SMALL_SENTENCES = [["the", "cat", "sat"], ["我", "爱", "自然语言处理的长长长长的词", "。"],
                   ["<bos>", "x", "<eos>", "<pad>", "<oov>", "<bow>"], ["The"], ["supercalifragilistic", "Ωmega", "👍🏽"]]


# -- the fixture ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixture_dir() -> Path:
    return data_path("formanylangs", "fixture_small")


@pytest.fixture(scope="module")
def sentences(fixture_dir) -> list[list[str]]:
    return json.loads((fixture_dir / "sentences.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def expected(fixture_dir, sentences) -> tuple[list[np.ndarray], list[np.ndarray]]:
    with h5py.File(fixture_dir / "expected.hdf5") as layers, h5py.File(fixture_dir / "expected_average.hdf5") as mean:
        return [layers[str(i)][...] for i in range(len(sentences))], [mean[str(i)][...] for i in range(len(sentences))]


@pytest.fixture(scope="module")
def imported(fixture_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "model"
    assert main(["import-formanylangs", str(fixture_dir / "model"), "--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def model(imported) -> BiLM:
    return BiLM.from_pretrained(str(imported)).eval()


def _layers(model: BiLM, sentences: list[list[str]]) -> list[np.ndarray]:
    with torch.inference_mode():
        result = model.embed(sentences)
    return [result.layers[:, i, :n].numpy() for i, n in enumerate(result.lengths)]


def _worst(got: list[np.ndarray], want: list[np.ndarray]) -> np.ndarray:
    """The largest absolute difference per layer (or overall for 2-d arrays) over all sentences."""
    return np.max([np.abs(g - w).reshape(g.shape[0] if g.ndim == 3 else 1, -1).max(axis=1)
                   for g, w in zip(got, want, strict=True)], axis=0)


def _assert_same_layers(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """As many sentences as wanted, each one's layers bit for bit."""
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_the_reference_reproduces_the_fixture(fixture_dir, sentences, expected):
    # the independent reference (formanylangs_family.py) is what the other shapes are held to
    got = [reference_layers(fixture_dir / "model", s) for s in sentences]
    assert _worst(got, expected[0]).max() < 1e-6


def test_the_python_api_reproduces_every_layer_of_every_sentence(fixture_dir, model, sentences, expected):
    got = _layers(model, sentences)
    worst = _worst(got, expected[0])
    assert worst.shape == (3,) and worst.max() < TOLERANCE, worst
    direct = BiLM.from_formanylangs(str(fixture_dir / "model")).eval()  # without the detour through our format
    _assert_same_layers(_layers(direct, sentences), got)
    alone = [_layers(model, [s])[0] for s in sentences[:12]]  # a sentence's vectors do not depend on its batch
    assert _worst(alone, got[:12]).max() <= 1e-6


@pytest.mark.parametrize("mode, batch_sizes", [("all", (1, 64)), ("average", (7, 40))])
def test_embed_file_reproduces_the_fixture_in_any_batch(imported, sentences, expected, tmp_path, mode, batch_sizes):
    lines = tmp_path / "sentences.tsv"
    lines.write_text("".join("\t".join(s) + "\n" for s in sentences), encoding="utf-8")
    outputs = []
    for batch_size in batch_sizes:
        out = tmp_path / f"{mode}-{batch_size}.hdf5"
        assert main(["embed-file", str(lines), str(out), f"--{mode}", "--tab-separated", "--model", str(imported),
                     "--batch-size", str(batch_size), "--quiet"]) == 0
        with h5py.File(out) as f:
            outputs.append([f[str(i)][...] for i in range(len(sentences))])
    want = expected[0] if mode == "all" else expected[1]
    for got in outputs:
        assert [g.shape for g in got] == [w.shape for w in want]
        assert _worst(got, want).max() < TOLERANCE
    assert _worst(outputs[0], outputs[1]).max() <= 1e-6  # deterministic: the batch changes nothing


# -- the family's input handling --------------------------------------------------------------------
def test_character_rows_and_word_keys_follow_the_family(model, fixture_dir):
    chars, vocab = model.chars, model.vocab
    eow, bow, pad, oov = (chars.index[c] for c in ("<eow>", "<bow>", "<pad>", "<oov>"))
    hi = model.char_ids(["Hi"])[0].tolist()
    assert hi == [eow, chars.index["H"], chars.index["i"], bow] + [pad] * 16
    assert model.char_ids(["<bos>"])[0].tolist()[:4] == [eow, chars.index["<bos>"], bow, pad]
    assert model.char_ids(["👍🏽"])[0].tolist()[:4] == [eow, oov, oov, bow]  # two code points, neither known
    assert model.char_ids(["全角\u3000空格"])[0, 3] == chars.index["\u3000"] == 447
    assert model.char_ids(["<oov>"])[0, 1:6].tolist() == [chars.index[c] for c in "<oov>"]
    long = "supercalifragilisticexpialidocious"
    assert model.token_keys([long, "flibbertigibbeting"]) == ["supercalifragilist", "flibbertigibbeting"]
    assert vocab.ids(model.token_keys([long, "hello", "Hello", "<bos>", "<pad>"])).tolist() == [
        vocab.index["supercalifragilist"], vocab.index["hello"], vocab.index["<oov>"], 1, 3]
    assert model.boundary_tokens == ("<bos>", "<eos>")
    same = _layers(model, [[long], ["supercalifragilistXYZ"]])
    np.testing.assert_array_equal(same[0][0], same[1][0])  # one key, one cache entry, one vector


def test_dictionaries_saved_with_a_byte_order_mark_read_as_without(fixture_dir, sentences, expected, tmp_path):
    """A BOM was read as part of the first token: char.dic's first character became unknown (the
    fixture's vectors off by 0.056) and word.dic's '<oov>' was missing."""
    folder = tmp_path / "model"
    shutil.copytree(fixture_dir / "model", folder)
    for name in ("char.dic", "word.dic"):
        (folder / name).chmod(0o644)
        (folder / name).write_bytes(b"\xef\xbb\xbf" + (folder / name).read_bytes().replace(b"\n", b"\r\n"))
    got = _layers(BiLM.from_formanylangs(str(folder)).eval(), sentences)
    assert _worst(got, expected[0]).max() < TOLERANCE
    # U+FEFF as a character of the dictionary, first, with or without a BOM before it, stays one
    for bom in ("", "\ufeff"):
        small = write_model(tmp_path / f"feff{len(bom)}", network(), ["\ufeff", *CHARS], WORDS)
        (small / "char.dic").write_text(bom + (small / "char.dic").read_text(encoding="utf-8"), encoding="utf-8")
        chars = BiLM.from_formanylangs(str(small)).chars
        assert chars.index["\ufeff"] == 0 and chars.index["a"] == 1


# every line end of str.splitlines but LF, three of them more than one byte in UTF-8, and \r\n
OTHER_LINE_ENDS = ["\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r\n"]


def test_a_dictionary_is_counted_by_every_line_end_before_it_is_parsed(tmp_path):
    """Only line feeds were counted: a char.dic one line longer than its table, its lines ended by
    carriage returns and the like, was parsed whole and refused only by the table's shape (a 48.8 MB
    word.dic of such lines took 26 s to parse). Each end counts one line, CR LF one too: a
    dictionary of as many lines as rows still loads."""
    entries = [*CHARS, "<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>"]

    def lines(items: list[str]) -> str:
        return "".join(f"{c}\t{i}{OTHER_LINE_ENDS[i % len(OTHER_LINE_ENDS)]}" for i, c in enumerate(items))

    folder = write_model(tmp_path / "m", network(), CHARS, WORDS)
    (folder / "char.dic").write_text(lines(entries), encoding="utf-8", newline="")
    assert BiLM.from_formanylangs(str(folder)).chars.entries == entries
    (folder / "char.dic").write_text(lines(["Z", *entries]), encoding="utf-8", newline="")
    with pytest.raises(CheckpointError, match=r"char\.dic: holds 48 lines or more, more than the 47 rows of "
                                              r"'char_emb_layer\.embedding\.weight' in .*; refused unparsed"):
        BiLM.from_formanylangs(str(folder))


FAMILY_SHAPES = {
    "word and chars": {},
    "no word embedding": {"word_dim": 0},
    "tanh, three highways": {"activation": "tanh", "n_highway": 3},
    "no highway": {"n_highway": 0},
    "short tokens": {"max_chars": 5, "filters": ((1, 3), (5, 4))},
    "three layers, clips that bite": {"n_layers": 3, "cell_clip": 0.05, "proj_clip": 0.02},
    "one layer, clips 0 and null": {"n_layers": 1, "cell_clip": 0, "proj_clip": None},
}


@pytest.mark.parametrize("shape", sorted(FAMILY_SHAPES))
def test_other_shapes_of_the_family_match_the_reference(tmp_path, shape):
    folder = write_model(tmp_path / "m", network(**FAMILY_SHAPES[shape]), CHARS, WORDS, seed=len(shape),
                         legacy=len(shape) % 2 == 0)
    loaded = BiLM.from_formanylangs(str(folder)).eval()
    assert (loaded.vocab is None) == (FAMILY_SHAPES[shape].get("word_dim") == 0)
    got = _layers(loaded, SMALL_SENTENCES)
    assert _worst(got, [reference_layers(folder, s) for s in SMALL_SENTENCES]).max() < TOLERANCE
    assert any(np.abs(g[1:]).max() > 0.01 for g in got)  # not a vacuous comparison


# -- refusals -------------------------------------------------------------------------------------
def _edit_json(name: str, edit):
    def apply(folder: Path) -> None:
        raw = json.loads((folder / name).read_text())
        edit(raw)
        (folder / name).write_text(json.dumps(raw))
    return apply


def _edit_state(name: str, edit):
    def apply(folder: Path) -> None:
        state = torch.load(folder / name, weights_only=True)
        edit(state)
        torch.save(state, folder / name)
    return apply


def _write(name: str, text: str | bytes):
    def apply(folder: Path) -> None:
        (folder / name).write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return apply


REFUSALS = {
    "lstm token embedder": (_edit_json("net.json", lambda r: r["token_embedder"].update(name="lstm")),
                            r"token_embedder 'lstm' \(the character LSTM\) is not supported"),
    "lstm encoder": (_edit_json("net.json", lambda r: r["encoder"].update(name="lstm")),
                     r"encoder 'lstm' is not supported: only models with encoder 'elmo'"),
    "no characters": (_edit_json("net.json", lambda r: r["token_embedder"].update(char_dim=0)),
                      r"char_dim 0 \(a model without characters\) is not supported"),
    "unknown activation": (_edit_json("net.json", lambda r: r["token_embedder"].update(activation="gelu")),
                           r"net\.json: token_embedder\.activation: expected one of 'relu' or 'tanh', got 'gelu'"),
    "missing field": (_edit_json("net.json", lambda r: r["encoder"].pop("dim")), r"encoder: missing field\(s\) \['dim'\]"),
    "missing config.json": (lambda f: (f / "config.json").unlink(), r"config\.json: not found"),
    "config.json without config_path": (_write("config.json", '{"seed": 1}'), r"expected an object with 'config_path'"),
    "unknown network config": (_edit_json("config.json", lambda r: r.update(config_path="nowhere/mine.json")),
                               r"config_path 'nowhere/mine\.json' names no file.*--network-config"),
    "NaN in a config": (_write("net.json", '{"encoder": NaN}'), r"net\.json: NaN is not valid JSON"),
    "missing char.dic": (lambda f: (f / "char.dic").unlink(), r"char\.dic: not found"),
    "missing word.dic": (lambda f: (f / "word.dic").unlink(), r"word\.dic: not found; token_embedder\.word_dim=8"),
    "missing encoder.pkl": (lambda f: (f / "encoder.pkl").unlink(), r"encoder\.pkl: not found"),
    "three fields": (_write("char.dic", "a\t0\tx\n"), r"char\.dic: line 1: expected token<TAB>id, got 'a\\t0\\tx'"),
    "id not a number": (_write("word.dic", "<oov>\t0\nthe\tone\n"), r"word\.dic: line 2: expected token<TAB>id"),
    "empty line": (_write("word.dic", "<oov>\t0\n\n<bos>\t1\n"), r"word\.dic: line 2: expected token<TAB>id, got ''"),
    "token twice": (_write("word.dic", "<oov>\t0\nthe\t1\nthe\t2\n"), r"line 3: 'the' is already on line 2"),
    "id twice": (_write("word.dic", "<oov>\t0\nthe\t1\na\t1\n"), r"line 3: id 1 is already given to 'the'"),
    "gap in ids": (_write("word.dic", "<oov>\t0\nthe\t2\n"), r"ids must be 0\.\.1, each once; id 1 is missing"),
    "not UTF-8": (_write("char.dic", b"\xff\t0\n"), r"char\.dic: not UTF-8 text"),
    "char special missing": (lambda f: write_dic(f / "char.dic", [*CHARS, "<bos>", "<eos>", "<oov>", "<pad>", "<bow>"]),
                             r"special entries \['<eow>'\] are missing"),
    "word special missing": (lambda f: write_dic(f / "word.dic", ["<oov>", "<eos>", "<pad>", *WORDS]),
                             r"word\.dic: .*\['<bos>'\] missing"),
    "<pad> missing": (lambda f: write_dic(f / "word.dic", ["<oov>", "<bos>", "<eos>", *WORDS]),
                      r"word\.dic: the entry '<pad>' is missing"),
    "dictionary larger than the table": (lambda f: write_dic(f / "char.dic", ["Z", *CHARS, "<bos>", "<eos>", "<oov>",
                                                                              "<pad>", "<bow>", "<eow>"]),
                                         r"char\.dic: holds 48 lines or more, more than the 47 rows of "
                                         r"'char_emb_layer\.embedding\.weight' in .*token_embedder\.pkl; refused unparsed"),
    "wrong shape": (_edit_state("encoder.pkl", lambda s: s.update({"forward_layer_1.state_projection.weight":
                                                                   torch.zeros(6, 11)})),
                    r"'forward_layer_1\.state_projection\.weight' has shape \(6, 11\), but encoder\.dim=10 .* needs \(6, 10\)"),
    "layer count": (_edit_json("net.json", lambda r: r["encoder"].update(n_layers=1000000)),
                    r"holds 2 of the numbered tensor groups 'forward_layer_N\.\*', but encoder\.n_layers=1000000"),
    "missing tensor": (_edit_state("token_embedder.pkl", lambda s: s.pop("projection.bias")),
                       r"token_embedder\.pkl: tensor 'projection\.bias' is missing"),
    "unexpected tensor": (_edit_state("token_embedder.pkl", lambda s: s.update(extra=torch.zeros(1))),
                          r"unexpected tensor 'extra'"),
    "integer tensor": (_edit_state("token_embedder.pkl", lambda s: s.update({"projection.bias": torch.zeros(6, dtype=torch.long)})),
                       r"'projection\.bias' has dtype torch\.int64, expected floating point"),
    "NaN tensor": (_edit_state("encoder.pkl", lambda s: s["forward_layer_0.state_linearity.bias"].fill_(float("nan"))),
                   r"'forward_layer_0\.state_linearity\.bias' holds NaN"),
    "not a state dict": (lambda f: torch.save([torch.zeros(1)], f / "encoder.pkl"), r"expected a state dict .* got list"),
    "not a tensor": (_edit_state("encoder.pkl", lambda s: s.update({"forward_layer_0.x": 3})), r"'forward_layer_0\.x' is a int"),
    "not a pickle": (_write("token_embedder.pkl", b"PK\x03\x04 not really"), r"token_embedder\.pkl: refused, not a plain PyTorch"),
    "float8 tensor": (_edit_state("encoder.pkl", lambda s: s.update({"forward_layer_0.state_linearity.bias": s[
        "forward_layer_0.state_linearity.bias"].to(torch.float8_e4m3fn)})),
        r"encoder\.pkl: tensor 'forward_layer_0\.state_linearity\.bias' has dtype torch\.float8_e4m3fn, expected "
        r"floating point \(float16, bfloat16, float32 or float64\)"),
    "sparse tensor": (_edit_state("token_embedder.pkl", lambda s: s.update({"projection.bias": torch.zeros(6).to_sparse()})),
                      r"token_embedder\.pkl: tensor 'projection\.bias' has layout torch\.sparse_coo, expected a dense"),
    "meta tensor": (_edit_state("token_embedder.pkl", lambda s: s.update({"projection.bias": torch.zeros(6, device="meta")})),
                    r"token_embedder\.pkl: tensor 'projection\.bias' is a meta tensor, which holds no values"),
    "a view of a larger storage": (_edit_state("token_embedder.pkl", lambda s: s.update({"projection.bias": torch.zeros(
        1000)[10:16]})), r"token_embedder\.pkl: tensor 'projection\.bias' \(24 bytes\) is a view into a storage of 4,000 "
                        r"bytes; refused"),
    "float64 past float32": (_edit_state("encoder.pkl", lambda s: s.update({"forward_layer_0.state_linearity.bias": s[
        "forward_layer_0.state_linearity.bias"].double() * 1e300})),
        r"encoder\.pkl: tensor 'forward_layer_0\.state_linearity\.bias' holds values beyond float32's range"),
    "an expanded view": (_edit_state("token_embedder.pkl", lambda s: s.update({"projection.bias": torch.zeros(1).expand(
        6)})), r"token_embedder\.pkl: tensor 'projection\.bias' views 24 bytes in a storage of 4 bytes \(its elements "
               r"share bytes, an expanded view\); refused"),
    "id of 5000 digits": (_write("word.dic", "<oov>\t0\nthe\t" + "1" * 5000 + "\n"),
                          r"word\.dic: line 2: expected token<TAB>id, got 'the\\t1111"),
    "1e999 in the network config": (_write("net.json", '{"encoder": {"cell_clip": 1e999}}'),
                                    r"net\.json: encoder\.cell_clip \(inf\) is not a finite number: '1e999' is beyond"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_model_the_family_cannot_have_or_we_cannot_run_is_refused_by_name(tmp_path, case):
    edit, message = REFUSALS[case]
    folder = write_model(tmp_path / "m", network(), CHARS, WORDS, legacy=False)
    edit(folder)
    with pytest.raises(CheckpointError, match=message):
        BiLM.from_formanylangs(str(folder))


def test_part_names_are_read_in_any_case_as_their_trainer_reads_them(small_model, tmp_path):
    """Their trainer lower-cases both names ('ELMo' trains the ELMo encoder, 'CNN' the character
    CNN), so a model it made may carry either in capitals: the same model as in lower case."""
    folder, want = small_model
    capitals = write_model(tmp_path / "m", network(), CHARS, WORDS, seed=7)
    _edit_json("net.json", lambda r: (r["encoder"].update(name="ELMo"), r["token_embedder"].update(name="CNN")))(capitals)
    _assert_same_layers(_layers(BiLM.from_formanylangs(str(capitals)).eval(), SMALL_SENTENCES), want)


@pytest.mark.parametrize("target", ["token_embedder.pkl", "encoder.pkl"])
@pytest.mark.parametrize("legacy", [True, False])
def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path, target, legacy):
    marker = tmp_path / "pwned"
    folder = write_model(tmp_path / "m", network(), CHARS, WORDS)
    pickle_bomb(folder / target, marker, **({"_use_new_zipfile_serialization": False} if legacy else {}))
    with pytest.raises(CheckpointError, match=rf"{re.escape(target)}: refused, not a plain PyTorch state dict.*"
                                              r"weights_only") as caught:
        BiLM.from_formanylangs(str(folder))
    # what torch found, without its advice to load the file unrestricted or to allow-list what it names
    # (the payload's module is `io` or, on Python 3.12, `_io`)
    assert re.search(r"\(torch\.load with weights_only=True: Unsupported global: GLOBAL _?io\.open was not an "
                     r"allowed global by default\)$", str(caught.value))
    assert "weights_only=False" not in str(caught.value) and "safe_globals" not in str(caught.value)
    archive = shutil.make_archive(str(tmp_path / "bomb"), "zip", folder)
    with pytest.raises(CheckpointError, match=rf"bomb\.zip!{re.escape(target)}: refused"):
        BiLM.from_formanylangs(archive)
    assert not marker.exists()
    torch.load(folder / target, weights_only=False)  # the same file read the unsafe way runs it: the test is live
    assert marker.exists()


# -- archives and URLs -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> tuple[Path, list[np.ndarray]]:
    folder = write_model(tmp_path_factory.mktemp("small") / "zhs.model", network(), CHARS, WORDS, seed=7)
    return folder, _layers(BiLM.from_formanylangs(str(folder)).eval(), SMALL_SENTENCES)


@pytest.mark.parametrize("legacy", [True, False])
def test_weights_saved_from_a_gpu_load_on_the_cpu(small_model, tmp_path, monkeypatch, legacy):
    """Their trainer saves its state dicts from the GPU, which torch records per storage, and their
    loader maps them to the CPU: without a GPU such files were refused ('Attempting to deserialize
    object on a CUDA device'). They load onto the CPU, the same model as saved from the CPU."""
    folder, want = small_model
    with monkeypatch.context() as patch:  # torch.save then tags every storage as on cuda:0
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        gpu = write_model(tmp_path / "gpu", network(), CHARS, WORDS, seed=7, legacy=legacy)
    data = (gpu / "encoder.pkl").read_bytes()
    assert b"cuda:0" in data
    assert {t.device.type for t in load_state_dict(data, "encoder.pkl").values()} == {"cpu"}
    _assert_same_layers(_layers(BiLM.from_formanylangs(str(gpu)).eval(), SMALL_SENTENCES), want)


def _zip_of_permission_bits(path: Path, folder: Path) -> str:
    """A zip as `zipfile.writestr` makes one from names: permission bits, no file type."""
    with zipfile.ZipFile(path, "w") as z:
        for file in folder.iterdir():
            info = zipfile.ZipInfo(f"{folder.name}/{file.name}")
            info.external_attr = 0o600 << 16
            z.writestr(info, file.read_bytes())
    return str(path)


@pytest.mark.parametrize("kind", ["zip", "zip-nested", "bztar", "xztar-nested", "gztar", "zip-permission-bits"])
def test_archives_load_exactly_as_the_folder(small_model, tmp_path, kind):
    folder, want = small_model
    fmt, nested = kind.split("-")[0], kind.endswith("nested")
    if kind.endswith("permission-bits"):
        archive = _zip_of_permission_bits(tmp_path / "zhs.model.zip", folder)
    else:
        archive = shutil.make_archive(str(tmp_path / "zhs.model"), fmt, folder.parent if nested else folder,
                                      folder.name if nested else None)
    loaded = BiLM.from_formanylangs(archive).eval()
    assert loaded.config.name == "zhs.model"
    _assert_same_layers(_layers(loaded, SMALL_SENTENCES), want)


def test_an_archive_saved_without_its_suffix_or_under_another_loads(small_model, tmp_path):
    """A download saved as '144' (or a zip named .tar.gz) was taken for a folder ('144/config.json:
    cannot be read (Not a directory)') or read as a tar."""
    folder, want = small_model
    zipped = Path(shutil.make_archive(str(tmp_path / "z"), "zip", folder.parent, folder.name)).read_bytes()
    bz2 = Path(shutil.make_archive(str(tmp_path / "b"), "bztar", folder.parent, folder.name)).read_bytes()
    with fsspec.open("memory://fml-suffix/download", "wb") as f:
        f.write(zipped)
    for location in (_file(tmp_path / "144", zipped), _file(tmp_path / "zhs", bz2), _file(tmp_path / "m.tar.gz", zipped),
                     "memory://fml-suffix/download"):
        _assert_same_layers(_layers(BiLM.from_formanylangs(str(location)).eval(), SMALL_SENTENCES), want)
    with pytest.raises(CheckpointError, match=r"config\.json: not a readable archive \(\.zip, \.tar"):
        BiLM.from_formanylangs(str(folder / "config.json"))  # a file of the model given for the model


def test_a_zip_made_on_windows_loads_and_its_backslash_tricks_are_refused(small_model, tmp_path):
    """Zips with `\\` separators (PowerShell's Compress-Archive writes them) were refused whole as
    'absolute or unsafe'."""
    folder, want = small_model
    archive = tmp_path / "zhs.model.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for file in folder.iterdir():
            z.writestr(f"{folder.name}\\{file.name}", file.read_bytes())
    _assert_same_layers(_layers(BiLM.from_formanylangs(str(archive)).eval(), SMALL_SENTENCES), want)
    for name, message in (("..\\evil", "points outside the archive"), ("a\\..\\..\\evil", "points outside the archive"),
                          ("\\evil", "has an absolute or unsafe name"), ("C:\\evil", "has an absolute or unsafe name")):
        with zipfile.ZipFile(archive, "a") as z:
            z.writestr(name, b"x")
        with pytest.raises(CheckpointError, match=rf"zhs\.model\.zip: member {re.escape(repr(name))} {message}"):
            BiLM.from_formanylangs(str(archive))
        with zipfile.ZipFile(archive) as z:  # that member out again
            members = [(info.filename, z.read(info)) for info in z.infolist() if info.filename != name]
        with zipfile.ZipFile(archive, "w") as z:
            for member, data in members:
                z.writestr(member, data)


def _tar_with(path: Path, folder: Path, extra: tarfile.TarInfo, data: bytes = b"") -> Path:
    with tarfile.open(path, "w:bz2") as tar:
        tar.add(folder, arcname=".")
        tar.addfile(extra, io.BytesIO(data) if data else None)
    return path


def _zip_with(path: Path, folder: Path, name: str, attr: int = 0) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for file in folder.iterdir():
            z.write(file, file.name)
        info = zipfile.ZipInfo(name)
        info.external_attr = attr << 16
        z.writestr(info, b"x")
    return path


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _info(name: str, kind: bytes = tarfile.REGTYPE, target: str = "", size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, target, size
    return info


@pytest.mark.parametrize("case, build, message", [
    ("zip ..", lambda d, f: _zip_with(d / "m.zip", f, "../evil.txt"), r"'\.\./evil\.txt' points outside the archive"),
    ("zip absolute", lambda d, f: _zip_with(d / "m.zip", f, "/etc/evil"), r"'/etc/evil' has an absolute or unsafe name"),
    ("zip symlink", lambda d, f: _zip_with(d / "m.zip", f, "link", 0o120777), r"'link' is a symbolic link"),
    ("zip FIFO", lambda d, f: _zip_with(d / "m.zip", f, "pipe", 0o010644), r"'pipe' is not a regular file"),
    ("tar ..", lambda d, f: _tar_with(d / "m.tar.bz2", f, _info("a/../../evil", size=1), b"x"), r"points outside"),
    ("tar absolute", lambda d, f: _tar_with(d / "m.tar.bz2", f, _info("/tmp/evil", size=1), b"x"), r"absolute or unsafe"),
    ("tar symlink", lambda d, f: _tar_with(d / "m.tar.bz2", f, _info("link", tarfile.SYMTYPE, "/etc/passwd")), r"is a link"),
    ("tar hardlink", lambda d, f: _tar_with(d / "m.tar.bz2", f, _info("hard", tarfile.LNKTYPE, "char.dic")), r"is a link"),
    ("tar device", lambda d, f: _tar_with(d / "m.tar.bz2", f, _info("dev", tarfile.CHRTYPE)), r"not a regular file"),
    ("zip twice", lambda d, f: _zip_with(d / "m.zip", f, "./char.dic", 0o100644), r"member 'char\.dic' appears twice"),
    ("tar twice", lambda d, f: _tar_with(d / "m.tar.bz2", f, _info("./char.dic", size=1), b"x"),
     r"member 'char\.dic' appears twice"),
    ("two models", lambda d, f: _tar_with(d / "m.tar.bz2", f, _info("other/config.json", size=2), b"{}"),
     r"several model folders \('', 'other'\)"),
    ("no model", lambda d, f: shutil.make_archive(str(d / "m"), "zip", f / "nothing"), r"the archive holds no config\.json"),
    ("not an archive", lambda d, f: _file(d / "m.zip", b"not a zip"), r"not a readable archive"),
    # one line: tarfile's message lists each compression it tried, a line each
    ("not a tar", lambda d, f: _file(d / "m.tar.xz", b"not a tar"),
     r"m\.tar\.xz: not a readable archive \(\.zip, \.tar, \.tar\.gz, \.tar\.bz2 or \.tar\.xz\): ReadError: "
     r"file could not be opened successfully\Z"),
])
def test_unsafe_or_unusable_archives_are_refused(small_model, tmp_path, case, build, message):
    folder = tmp_path / "m"
    shutil.copytree(small_model[0], folder)
    (folder / "nothing").mkdir()
    (folder / "nothing" / "readme.txt").write_text("no model here")
    with pytest.raises(CheckpointError, match=message):
        BiLM.from_formanylangs(str(build(tmp_path, folder)))


def test_a_damaged_compressed_tar_is_refused_not_loaded(small_model, tmp_path):
    """tarfile stops at the end-of-archive blocks, before gzip's CRC-32 and xz's check: a .tar.gz
    with one changed byte loaded its wrong bytes, and a damaged .tar.xz or deflate stream raised
    lzma's or zlib's own error, naming no file."""
    folder = small_model[0]
    stored = tmp_path / "stored.tar.gz"
    with tarfile.open(stored, "w:gz", compresslevel=0) as tar:  # stored blocks: the tar's bytes as they are
        tar.add(folder, arcname=folder.name)
    data = stored.read_bytes()
    assert data.count(b"\ncat\t5\n") == 1
    stored.write_bytes(data.replace(b"\ncat\t5\n", b"\ncau\t5\n"))  # a word of word.dic, one bit away
    with pytest.raises(CheckpointError, match=r"stored\.tar\.gz: not a readable archive .*CRC check failed"):
        BiLM.from_formanylangs(str(stored))
    for kind in ("gz", "xz"):
        archive = tmp_path / f"m.tar.{kind}"
        with tarfile.open(archive, f"w:{kind}") as tar:
            tar.add(folder, arcname=folder.name)
        data = archive.read_bytes()
        for position in (len(data) // 3, len(data) // 2, 2 * len(data) // 3):
            broken = tmp_path / f"broken.tar.{kind}"
            broken.write_bytes(data[:position] + bytes([data[position] ^ 0x10]) + data[position + 1:])
            with pytest.raises(CheckpointError, match=rf"broken\.tar\.{kind}: not a readable archive"):
                BiLM.from_formanylangs(str(broken))
    archive.write_bytes(data[:-4])  # cut short after the last member, whose bytes are whole
    with pytest.raises(CheckpointError, match=r"m\.tar\.xz: not a readable archive .*ended before the end-of-stream"):
        BiLM.from_formanylangs(str(archive))


def _bomb_in_miniature(small_model, tmp_path: Path, archive_format: str) -> tuple[Path, Path]:
    """The model folder with 2 MB of zeros beside it, and its archive (they compress to almost nothing)."""
    folder = tmp_path / "m"
    shutil.copytree(small_model[0], folder)
    (folder / "zeros.bin").write_bytes(bytes(2_000_000))
    archive = Path(shutil.make_archive(str(tmp_path / "m"), archive_format, folder))
    assert archive.stat().st_size < 100_000
    return folder, archive


def _refused_past_each_size_limit(archive: Path, monkeypatch) -> None:
    """The archive of `_bomb_in_miniature` is refused, naming it, past a file's limit and past the total."""
    monkeypatch.setattr(sources, "MAX_FILE_BYTES", 1_000_000)
    with pytest.raises(CheckpointError, match=re.escape(f"{archive.name}: member 'zeros.bin' holds more than "
                                                        "1,000,000 bytes")):
        BiLM.from_formanylangs(str(archive))
    monkeypatch.setattr(sources, "MAX_FILE_BYTES", 2_000_000)
    monkeypatch.setattr(sources, "MAX_TOTAL_BYTES", 2_000_100)
    with pytest.raises(CheckpointError, match=re.escape(f"{archive.name}: its files hold more than 2,000,100 bytes")):
        BiLM.from_formanylangs(str(archive))


def test_size_limits_hold_on_the_bytes_read(small_model, tmp_path, monkeypatch):
    folder, archive = _bomb_in_miniature(small_model, tmp_path, "gztar")
    _refused_past_each_size_limit(archive, monkeypatch)
    monkeypatch.setattr(sources, "MAX_MEMBERS", 3)
    with pytest.raises(CheckpointError, match=r"more than 3 members"):
        BiLM.from_formanylangs(str(archive))
    monkeypatch.setattr(sources, "MAX_FILE_BYTES", (folder / "encoder.pkl").stat().st_size - 1)
    with pytest.raises(CheckpointError, match=r"encoder\.pkl: larger than the .* bytes a model file may have"):
        BiLM.from_formanylangs(str(folder))  # a folder's files too
    with pytest.raises(CheckpointError, match=r"m\.tar\.gz: larger than"):
        BiLM.from_formanylangs(shutil.make_archive(str(tmp_path / "m"), "gztar", small_model[0]))  # the archive itself


def test_a_zip_member_declaring_past_the_limits_is_refused_before_it_is_inflated(small_model, tmp_path, monkeypatch):
    """A zip's sizes were counted only on the bytes read: a 4 MB zip whose member inflates to
    4 GiB + 16 MiB took 23 s and 8.4 GB of memory to be refused. zipfile reads no more of a member
    than its header declares, so the declared sizes are checked first, as a tar's are."""
    _, archive = _bomb_in_miniature(small_model, tmp_path, "zip")
    opened = []
    read_member = zipfile.ZipFile.open
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, name, *a, **k: opened.append(name) or
                        read_member(self, name, *a, **k))
    _refused_past_each_size_limit(archive, monkeypatch)
    assert opened == []


def test_tar_headers_are_counted_as_they_are_read(tmp_path, monkeypatch):
    path = tmp_path / "many.tar.bz2"
    with tarfile.open(path, "w:bz2") as tar:
        for i in range(50):
            tar.addfile(_info(f"m/x{i}"))
    monkeypatch.setattr(sources, "MAX_MEMBERS", 3)
    headers = []
    read_header = tarfile.TarFile.next
    monkeypatch.setattr(tarfile.TarFile, "next", lambda self: headers.append(1) or read_header(self))
    with pytest.raises(CheckpointError, match=r"many\.tar\.bz2: more than 3 members; refused"):
        BiLM.from_formanylangs(str(path))
    assert len(headers) < 10  # up to the fourth (and the tries of opening it), not all 50


@pytest.mark.parametrize("members, prefix", [
    (50, b""),
    (50, b"#!/bin/sh\n" * 10),  # bytes before the zip, as a self-extracting archive has
    (70_000, b""),  # past 65,535 entries: the zip64 end records
])
def test_zip_directory_entries_are_counted_before_zipfile_reads_them(tmp_path, monkeypatch, members, prefix):
    path = tmp_path / "many.zip"
    with path.open("wb") as f:
        f.write(prefix)
        with zipfile.ZipFile(f, "w") as z:
            for i in range(members):
                z.writestr(f"m/x{i}", b"")
    monkeypatch.setattr(sources, "MAX_MEMBERS", 3)
    opened = []
    monkeypatch.setattr(sources.zipfile, "ZipFile", lambda *a, **k: opened.append(1))  # would build every entry
    with pytest.raises(CheckpointError, match=r"many\.zip: more than 3 members; refused"):
        BiLM.from_formanylangs(str(path))
    assert opened == []


def _deflated(data: bytes, padding: int = 0) -> bytes:
    """A torch.save file with its storages re-written DEFLATE-compressed, which torch's reader
    inflates; the first one `padding` zero bytes longer than the storage the pickle declares."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            record = src.read(info)
            if info.filename.endswith("/data/0"):
                record += bytes(padding)
            kind = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            z.writestr(info.filename, record, compress_type=kind)
    return out.getvalue()


def test_a_compressed_storage_is_not_inflated_before_its_size_is_checked(small_model, tmp_path, monkeypatch):
    folder = tmp_path / "m"
    shutil.copytree(small_model[0], folder)
    state = torch.load(folder / "encoder.pkl", weights_only=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (folder / "encoder.pkl").write_bytes(_deflated(buffer.getvalue()))  # honest, only compressed: loads as before
    _assert_same_layers(_layers(BiLM.from_formanylangs(str(folder)).eval(), SMALL_SENTENCES), small_model[1])
    key = "forward_layer_0.state_linearity.bias"
    big = torch.zeros(1 << 24)  # 64 MiB of zeros that DEFLATE keeps in 64 KB; the audit's took 4 GiB from 4 MB
    big[: state[key].numel()] = state[key]
    state[key] = big[: state[key].numel()]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (folder / "encoder.pkl").write_bytes(_deflated(buffer.getvalue()))
    assert (folder / "encoder.pkl").stat().st_size < 1_000_000
    locations = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kw: locations.append(kw["map_location"]) or load(*args, **kw))
    with pytest.raises(CheckpointError, match=rf"encoder\.pkl: tensor '{key}' \(160 bytes\) is a view into a storage "
                                              r"of 67,108,864 bytes; refused"):
        BiLM.from_formanylangs(str(folder))
    assert locations == ["meta", "cpu", "meta"]  # token_embedder.pkl, then encoder.pkl without its storages only
    # a record inflating past the storage it holds: torch reads it whole before it compares sizes
    state = load(small_model[0] / "encoder.pkl", weights_only=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (folder / "encoder.pkl").write_bytes(_deflated(buffer.getvalue(), padding=1 << 26))
    locations.clear()
    with pytest.raises(CheckpointError, match=r"encoder\.pkl: its zip records inflate to [0-9,]+ bytes, more than its "
                                              r"tensors \([0-9,]+ bytes\) and the file \([0-9,]+ bytes\) account for"):
        BiLM.from_formanylangs(str(folder))
    assert locations == ["meta", "cpu", "meta"]


def test_the_tensors_of_a_pkl_are_bounded_in_all(small_model, tmp_path, monkeypatch):
    from elmo_pipeline.formats import formanylangs

    state = torch.load(small_model[0] / "encoder.pkl", weights_only=True)
    total = sum(t.numel() * t.element_size() for t in state.values())
    monkeypatch.setattr(formanylangs, "MAX_FILE_BYTES", total - 1)
    with pytest.raises(CheckpointError, match=rf"encoder\.pkl: its tensors hold more than {total - 1:,} bytes; refused"):
        BiLM.from_formanylangs(str(small_model[0]))
    monkeypatch.setattr(formanylangs, "MAX_FILE_BYTES", total)
    BiLM.from_formanylangs(str(small_model[0]))


@pytest.mark.parametrize("kind", ["memory folder", "memory zip", "file URL"])
def test_url_inputs(small_model, tmp_path, kind):
    folder, want = small_model
    if kind == "memory folder":
        location = "memory://fml-test/zhs.model"
        for file in folder.iterdir():
            with fsspec.open(f"{location}/{file.name}", "wb") as f:
                f.write(file.read_bytes())
    elif kind == "memory zip":
        location = "memory://fml-test/zhs.model.zip"
        with fsspec.open(location, "wb") as f:
            f.write(Path(shutil.make_archive(str(tmp_path / "z"), "zip", folder)).read_bytes())
    else:
        location = folder.as_uri()
    _assert_same_layers(_layers(BiLM.from_formanylangs(location).eval(), SMALL_SENTENCES), want)


def test_the_folder_a_model_was_unpacked_into_loads_as_its_archive_does(small_model, tmp_path, capsys):
    """An archive's model may lie one folder down, but the folder it was unpacked into was refused
    ('config.json: not found')."""
    folder, want = small_model
    shutil.copytree(folder, tmp_path / "downloads" / folder.name)
    (tmp_path / "downloads" / "notes").mkdir()
    memory = f"memory://fml-unpacked/{tmp_path.name}"
    for file in folder.iterdir():
        with fsspec.open(f"{memory}/{folder.name}/{file.name}", "wb") as f:
            f.write(file.read_bytes())
    for location in (str(tmp_path / "downloads"), memory):
        loaded = BiLM.from_formanylangs(location).eval()
        assert loaded.config.name == "zhs.model"
        _assert_same_layers(_layers(loaded, SMALL_SENTENCES), want)
    shutil.copytree(folder, tmp_path / "downloads" / "en.model")
    with pytest.raises(CheckpointError, match=r"downloads: holds no config\.json but several model folders "
                                              r"\('en\.model', 'zhs\.model'\); give one"):
        BiLM.from_formanylangs(str(tmp_path / "downloads"))
    shutil.rmtree(tmp_path / "downloads" / "en.model")
    model = tmp_path / "downloads" / "zhs.model"
    for source in (model, model.parent):  # replacing the model folder would delete what is read
        assert main(["import-formanylangs", str(source), "--output", str(model), "--overwrite"]) == 2
        assert f"{model} holds {model}, which this command reads" in capsys.readouterr().err
    assert sorted(p.name for p in model.iterdir()) == sorted(p.name for p in folder.iterdir())


def test_an_empty_model_location_or_network_config_is_refused(small_model, tmp_path, monkeypatch, capsys):
    """'' (an unset variable) was the current folder: the model there, or one folder below, was
    imported; an empty --network-config said ': cannot be read (Is a directory)'."""
    monkeypatch.chdir(small_model[0])
    for location, net_config, message in (("", None, "the model location is an empty string"),
                                          (" ", None, "the model location is an empty string"),
                                          (".", "", "the network config is an empty string")):
        with pytest.raises(CheckpointError, match=f"^{message}; name its"):
            BiLM.from_formanylangs(location, network_config=net_config)
    assert main(["import-formanylangs", "", "--output", "out"]) == 2
    assert "the model location is an empty string" in capsys.readouterr().err
    assert not (small_model[0] / "out").exists()
    for name in ("a", "b"):  # a folder of models: still the empty string that is named
        shutil.copytree(small_model[0], tmp_path / name)
    monkeypatch.chdir(tmp_path)
    assert main(["import-formanylangs", "", "--output", "out"]) == 2
    assert "the model location is an empty string" in capsys.readouterr().err


# -- config_path ---------------------------------------------------------------------------------
def test_config_path_falls_back_beside_config_json_then_to_the_standard_configs(small_model, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(small_model[0], folder)
    options = json.loads((folder / "config.json").read_text())
    options["config_path"] = "../configs/net.json"  # as released: a path that is not there
    (folder / "config.json").write_text(json.dumps(options))
    _assert_same_layers(_layers(BiLM.from_formanylangs(str(folder)).eval(), SMALL_SENTENCES), small_model[1])
    options["config_path"] = "../configs/cnn_50_100_512_4096_sample.json"
    (folder / "config.json").write_text(json.dumps(options))
    # the standard network is used, so these small weights do not fit it
    with pytest.raises(CheckpointError, match=r"token_embedder\.filters \(one convolution each\)=7 in the standard "
                                              r"cnn_50_100_512_4096_sample\.json"):
        BiLM.from_formanylangs(str(folder))
    explicit = BiLM.from_formanylangs(str(folder), network_config=str(folder / "net.json")).eval()
    np.testing.assert_array_equal(_layers(explicit, SMALL_SENTENCES)[0], small_model[1][0])


@pytest.mark.parametrize("config_path, inside", [
    ("configs\\net.json", "configs"),  # written on Windows, relative to the model folder
    ("..\\configs\\net.json", "../configs"),
    ("../configs/net.json", "configs"),  # the released text, with the configs/ folder put inside the model
    ("../configs/cnn_50_100_512_4096_sample.json", "configs"),  # a standard name: the model's own file wins
])
def test_config_path_is_found_as_a_user_lays_the_model_out(small_model, tmp_path, config_path, inside):
    folder = tmp_path / "elmo" / "zhs.model"
    shutil.copytree(small_model[0], folder)
    options = json.loads((folder / "config.json").read_text())
    options["config_path"] = config_path
    (folder / "config.json").write_text(json.dumps(options))
    (folder / inside).mkdir(parents=True)
    (folder / "net.json").rename(folder / inside / config_path.replace("\\", "/").rsplit("/", 1)[1])
    archive = shutil.make_archive(str(tmp_path / "zhs.model"), "zip", tmp_path / "elmo")
    memory = f"memory://fml-layout/{tmp_path.name}"  # a bucket: `..` is no folder there
    for file in (tmp_path / "elmo").rglob("*"):
        if file.is_file():
            with fsspec.open(f"{memory}/{file.relative_to(tmp_path / 'elmo').as_posix()}", "wb") as f:
                f.write(file.read_bytes())
    for location in (str(folder), archive, f"{memory}/zhs.model"):
        _assert_same_layers(_layers(BiLM.from_formanylangs(location).eval(), SMALL_SENTENCES), small_model[1])


def test_the_standard_configs_are_the_familys(fixture_dir):
    for name, config in STANDARD_NETWORK_CONFIGS.items():
        shipped = json.loads(data_path("formanylangs", "configs", name).read_text())
        assert config == shipped, name


# -- our format ----------------------------------------------------------------------------------
def test_round_trip_through_our_format(imported, model, sentences, tmp_path):
    names = sorted(p.name for p in imported.iterdir())
    assert names == ["chars.json", "config.json", "model.safetensors", "vocab.json"]
    config = json.loads((imported / "config.json").read_text())
    assert config["char_dictionary"] == {"size": 454} and config["token_encoder"] == "char_cnn+word"
    assert json.loads((imported / "vocab.json").read_text())["specials"] == ["<bos>", "<eos>", "<oov>"]
    model.save_pretrained(str(tmp_path / "again"))
    again = BiLM.from_pretrained(str(tmp_path / "again")).eval()
    assert again.config == model.config and again.chars == model.chars
    assert again.vocab.tokens == model.vocab.tokens and again.vocab.specials == model.vocab.specials
    _assert_same_layers(_layers(again, sentences), _layers(model, sentences))


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "chars.json").unlink(), r"chars\.json: file not found"),
    (lambda d: (d / "chars.json").write_text('{"characters": ["a", "a"]}'), r"chars\.json: .*'a' appears twice"),
    (lambda d: (d / "chars.json").write_text('{"characters": ["a", "<bos>", "<eos>", "<oov>", "<pad>", "<bow>", '
                                             '"<eow>"]}'),
     r"chars\.json: has 7 entries, but char_dictionary\.size=454 in .*config\.json needs 454"),
    (lambda d: (d / "vocab.json").write_text(json.dumps({"tokens": ["<S>", "</S>", "<UNK>", *map(str, range(423))]})),
     r"needs the specials \['<bos>', '<eos>', '<oov>'\]"),
])
def test_a_damaged_imported_model_is_refused(imported, tmp_path, edit, message):
    folder = tmp_path / "m"
    shutil.copytree(imported, folder)
    edit(folder)
    with pytest.raises((CheckpointError, ValueError), match=message):
        BiLM.from_pretrained(str(folder))


def test_the_output_folder_is_new_or_a_model_folder_with_overwrite(fixture_dir, imported, tmp_path, capsys):
    source = str(fixture_dir / "model")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["import-formanylangs", source, "--output", str(tmp_path / "busy"), "--overwrite"]) == 2
    assert "holds files but no config.json: not a model folder" in capsys.readouterr().err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    shutil.copytree(imported, tmp_path / "old")
    assert main(["import-formanylangs", source, "--output", str(tmp_path / "old")]) == 2
    assert "is not empty" in capsys.readouterr().err
    (tmp_path / "old" / "stale.txt").write_text("from before")
    assert main(["import-formanylangs", source, "--output", str(tmp_path / "old"), "--overwrite"]) == 0
    assert "network config: " in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == sorted(p.name for p in imported.iterdir())
    (tmp_path / "taken").write_text("a file")
    assert main(["import-formanylangs", source, "--output", str(tmp_path / "taken"), "--overwrite"]) == 2
    assert "is an existing file; it must name a folder" in capsys.readouterr().err
    assert main(["import-formanylangs", source, "--output", str(tmp_path / "taken" / "model")]) == 2
    assert f"cannot be created as a folder: {tmp_path / 'taken'} is an existing file" in capsys.readouterr().err
    assert (tmp_path / "taken").read_text() == "a file"


def test_an_import_does_not_replace_the_folder_it_reads(fixture_dir, tmp_path, capsys):
    """An ELMoForManyLangs folder has a config.json, so --output SOURCE --overwrite took it for a
    model folder to replace, and deleted the downloaded model."""
    source = tmp_path / "fml"
    shutil.copytree(fixture_dir / "model", source)
    before = sorted(p.name for p in source.iterdir())
    url = f"file://{source}"
    for given, output in ((str(source), str(source)), (url, str(source)), (str(source), url),
                          (f"simplecache::{url}", str(source / "."))):
        assert main(["import-formanylangs", given, "--output", output, "--overwrite"]) == 2
        assert f"{output} holds {given}, which this command reads: replacing the folder would delete it" in \
            capsys.readouterr().err
        assert sorted(p.name for p in source.iterdir()) == before
