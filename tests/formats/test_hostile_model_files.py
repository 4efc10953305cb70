"""Damaged or hostile model files, in each format we load: each is refused when loaded, naming
the file and the field or tensor, and never loads to fail later in the model's own code."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmo_pipeline import BiLM, ElmoConfig
from elmo_pipeline.formats.files import CheckpointError
from elmo_pipeline.model.config import CharCnnConfig, LstmConfig, SoftmaxConfig
from elmo_pipeline.model.vocabulary import SPECIALS, Vocabulary
from elmo_pipeline.strict import ConfigError
from benchmarks.formanylangs_family import network, write_model
from support import HttpServer

SENTENCES = [["The", "bank", "of", "the", "river"], ["He", "went"]]
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _clipped_model(folder: Path, cell_clip: float | None = 3.0, proj_clip: float | None = 3.0) -> Path:
    torch.manual_seed(0)
    cnn = CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 4)), n_highway=1)
    lstm = LstmConfig(dim=16, projection_dim=8, cell_clip=cell_clip, proj_clip=proj_clip)
    BiLM(ElmoConfig(lstm=lstm, char_cnn=cnn)).save_pretrained(str(folder))
    return folder


def _with_lstm_field(config: Path, field: str, value: float) -> None:
    raw = json.loads(config.read_text())
    raw["lstm"][field] = value
    config.write_text(json.dumps(raw))


def _layers(model: BiLM) -> np.ndarray:
    with torch.no_grad():
        return model.embed(SENTENCES).layers.numpy()


@pytest.mark.parametrize("field", ["cell_clip", "proj_clip"])
def test_a_clip_past_float32_is_refused_naming_the_file_and_field(tmp_path, field):
    # It loaded, and then every sentence failed in torch's clamp ("value cannot be converted to
    # type float without overflow"): extract's job failed after reading, embed-file named nothing.
    folder = _clipped_model(tmp_path / "m")
    _with_lstm_field(folder / "config.json", field, 1e308)
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_pretrained(str(folder))
    assert str(refused.value) == (f"{folder / 'config.json'}: lstm.{field}: a clip must be at most "
                                  "3.4028234663852886e+38, float32's largest value (the model's), got 1e+308")


def test_a_clip_at_float32s_largest_value_loads_and_clips_nothing(tmp_path):
    unclipped = _layers(BiLM.from_pretrained(str(_clipped_model(tmp_path / "none", None, None))))
    widest = _clipped_model(tmp_path / "widest", None, None)
    for field in ("cell_clip", "proj_clip"):
        _with_lstm_field(widest / "config.json", field, FLOAT32_MAX)
    model = BiLM.from_pretrained(str(widest))
    assert (model.config.lstm.cell_clip, model.config.lstm.proj_clip) == (FLOAT32_MAX, FLOAT32_MAX)
    np.testing.assert_array_equal(_layers(model), unclipped)


def test_an_original_options_clip_past_float32_is_refused_naming_it(elmo_fixture_dir, tmp_path):
    options = tmp_path / "options.json"
    options.write_text((elmo_fixture_dir / "options.json").read_text())
    _with_lstm_field(options, "proj_clip", 1e39)
    with pytest.raises(ConfigError, match=f"^{options}: lstm.proj_clip: a clip must be at most 3.4028234663852886e"):
        BiLM.from_allennlp(str(options), str(elmo_fixture_dir / "lm_weights.hdf5"))


def test_a_formanylangs_clip_past_float32_is_refused_naming_the_network_config(tmp_path):
    folder = write_model(tmp_path / "fml", network(cell_clip=1e308), list("abc"), ["the", "cat"])
    with pytest.raises(CheckpointError, match=f"^{folder / 'net.json'}: encoder.cell_clip: must be <= "
                                              "3.4028234663852886e\\+38, got 1e\\+308$"):
        BiLM.from_formanylangs(str(folder))


@pytest.mark.parametrize("name", ["char_embed", "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"])
def test_an_hdf5_dataset_of_no_values_is_refused_naming_it(elmo_fixture_dir, tmp_path, name):
    # A null dataspace (h5py.Empty) has the shape None: our own code failed with a TypeError,
    # "'NoneType' object is not iterable" (or "... not subscriptable" for char_embed).
    weights = tmp_path / "weights.hdf5"
    weights.write_bytes((elmo_fixture_dir / "lm_weights.hdf5").read_bytes())
    with h5py.File(weights, "a") as f:
        del f[name]
        f.create_dataset(name, data=h5py.Empty("f4"))
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(weights))
    assert str(refused.value) == (f"{weights}: tensor {name!r} is an empty dataset (a null dataspace), which holds "
                                  "no values")


def test_an_adaptive_softmax_of_more_clusters_than_the_weights_hold_is_refused_before_it_is_built(tmp_path):
    # Each cutoff is a tail cluster, a module of its own: the config's model, built on the meta
    # device to be compared with the weights, took 30 s and 1.4 GB for 100,000 cutoffs (8.8 s for
    # 33,000) before the first tensor was compared; they are counted first, as layers are.
    vocab = Vocabulary([*SPECIALS, *(f"w{i}" for i in range(20_000))])
    cnn = CharCnnConfig(embedding_dim=4, filters=((1, 4),))
    config = ElmoConfig(lstm=LstmConfig(dim=8, projection_dim=4), char_cnn=cnn, vocab_size=len(vocab),
                        softmax=SoftmaxConfig(kind="adaptive", cutoffs=(10,), div_value=2.0))
    folder = tmp_path / "m"
    BiLM(config, vocab).save_pretrained(str(folder))
    raw = json.loads((folder / "config.json").read_text())
    raw["softmax"].update(cutoffs=list(range(1, 20_000)), div_value=1.00001)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_pretrained(str(folder))
    assert str(refused.value) == (
        f"{folder / 'model.safetensors'}: holds 1 of the numbered tensor groups 'softmax.adaptive.tail.N.*', but "
        f"softmax.cutoffs (one tail cluster each)=19999 in {folder / 'config.json'} needs 19999")


def _word_model(folder: Path, words: list[str]) -> Path:
    torch.manual_seed(0)
    vocab = Vocabulary([*SPECIALS, *words], counts=list(range(len(words) + 3)))
    config = ElmoConfig(lstm=LstmConfig(dim=8, projection_dim=4), char_cnn=None, token_encoder="word",
                        word_embedding_dim=4, vocab_size=len(vocab))
    BiLM(config, vocab).save_pretrained(str(folder))
    return folder


def test_a_vocabulary_far_longer_than_the_config_says_is_refused_before_it_is_parsed(tmp_path):
    # Parsed whole, then compared with vocab_size: a 99 MB vocab.json (10 million tokens beside a
    # config of 33,279) took 3.2 GB and 35 s to be refused; its items are counted first.
    folder = _word_model(tmp_path / "m", ["the", "cat"])
    (folder / "vocab.json").write_text(json.dumps({"tokens": [*SPECIALS, *(f"w{i}" for i in range(100_000))]}))
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_pretrained(str(folder))
    assert str(refused.value) == (f"{folder / 'vocab.json'}: holds more than the 16 items that vocab_size=5 in "
                                  f"{folder / 'config.json'} allows; refused unparsed")


def test_a_character_dictionary_far_longer_than_the_config_says_is_refused_before_it_is_parsed(tmp_path):
    folder = tmp_path / "m"
    BiLM.from_formanylangs(str(write_model(tmp_path / "fml", network(), list("abc"), ["the"]))).save_pretrained(folder)
    chars = json.loads((folder / "chars.json").read_text())["characters"]
    (folder / "chars.json").write_text(json.dumps({"characters": [*chars, *(chr(0x4E00 + i) for i in range(5000))]}))
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_pretrained(str(folder))
    assert str(refused.value) == (f"{folder / 'chars.json'}: holds more than the 10 items that char_dictionary.size=9 "
                                  f"in {folder / 'config.json'} allows; refused unparsed")


def test_tokens_holding_commas_quotes_and_backslashes_are_not_counted_as_items(tmp_path):
    # the items are counted outside strings: each of these tokens is one item
    words = [",", "1,000", '",", ",",', "\\", '\\",', ",\\\\", "a,b,c,d,e,f,g,h"]
    loaded = BiLM.from_pretrained(str(_word_model(tmp_path / "m", words)))
    assert loaded.vocab.tokens == [*SPECIALS, *words]
    assert loaded.vocab.counts == list(range(len(words) + 3))


def test_a_formanylangs_dictionary_far_longer_than_its_table_is_refused_before_it_is_parsed(tmp_path):
    # Parsed whole, then compared with the embedder's rows: a 126 MB word.dic (8 million lines)
    # took 2.9 GB and 36 s to be refused; its lines are counted against the rows first.
    folder = write_model(tmp_path / "fml", network(), list("abc"), ["the", "cat"])
    with open(folder / "word.dic", "a", encoding="utf-8") as dic:
        dic.writelines(f"w{i}\t{i + 6}\n" for i in range(100_000))
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_formanylangs(str(folder))
    assert str(refused.value) == (f"{folder / 'word.dic'}: holds 100,006 lines or more, more than the 6 rows of "
                                  f"'word_emb_layer.embedding.weight' in {folder / 'token_embedder.pkl'}; refused "
                                  "unparsed")


def test_a_vocabulary_swapped_for_another_changes_the_models_checksum(tmp_path):
    # The checksum (the outputs' "sha256 of its files", what probe --reuse-features compares) covered
    # config.json and model.safetensors only: the default model with 'the' and 'cat' swapped in its
    # vocab.json kept it, while its vectors moved by up to 5.9.
    folder = _word_model(tmp_path / "m", ["the", "cat"])
    original = BiLM.from_pretrained(str(folder))
    raw = json.loads((folder / "vocab.json").read_text())
    raw["tokens"][3:5] = ["cat", "the"]
    (folder / "vocab.json").write_text(json.dumps(raw))
    swapped = BiLM.from_pretrained(str(folder))
    with torch.no_grad():
        assert not torch.equal(original.embed([["the"]]).layers, swapped.embed([["the"]]).layers)
    files = [(folder / name).read_bytes() for name in ("config.json", "model.safetensors", "vocab.json")]
    assert swapped.checksum == hashlib.sha256(b"".join(files)).hexdigest() != original.checksum


def test_the_original_pairs_checksum_covers_its_options(elmo_fixture_dir, tmp_path):
    """The same weights under options.json of another cell clip are another model (other vectors):
    the checksum is sha256(options.json + weights), so it tells the two apart."""
    raw = json.loads((elmo_fixture_dir / "options.json").read_text())
    raw["lstm"]["cell_clip"] = 0.5
    (tmp_path / "options.json").write_text(json.dumps(raw))
    weights = elmo_fixture_dir / "lm_weights.hdf5"
    original = BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(weights))
    clipped = BiLM.from_allennlp(str(tmp_path / "options.json"), str(weights))
    with torch.no_grad():
        assert not torch.equal(original.embed([["a", "rose"]]).layers, clipped.embed([["a", "rose"]]).layers)
    want = hashlib.sha256((tmp_path / "options.json").read_bytes() + weights.read_bytes()).hexdigest()
    assert clipped.checksum == want != original.checksum


def test_a_model_without_a_vocabulary_keeps_its_checksum(tmp_path):
    folder = _clipped_model(tmp_path / "m")
    files = [(folder / name).read_bytes() for name in ("config.json", "model.safetensors")]
    assert BiLM.from_pretrained(str(folder)).checksum == hashlib.sha256(b"".join(files)).hexdigest()


_W_0 = "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"


def _weights_with_w_0(elmo_fixture_dir: Path, tmp_path: Path, **dataset) -> Path:
    weights = tmp_path / "weights.hdf5"
    weights.write_bytes((elmo_fixture_dir / "lm_weights.hdf5").read_bytes())
    with h5py.File(weights, "a") as f:
        values = f[_W_0][...]
        del f[_W_0]
        created = f.create_dataset(_W_0, shape=values.shape, dtype="f4", **dataset)
        if "chunks" in dataset:
            created[: dataset["chunks"][0]] = values[: dataset["chunks"][0]]  # the first chunks' rows only
    return weights


def test_an_hdf5_dataset_never_written_is_refused_not_read_as_zeros(elmo_fixture_dir, tmp_path):
    # Its values read as the fill value: the model loaded with that LSTM's input weights all 0,
    # and its vectors moved by up to 2.1 without a word.
    weights = _weights_with_w_0(elmo_fixture_dir, tmp_path)
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(weights))
    assert str(refused.value) == (f"{weights}: tensor {_W_0!r} was never written (the file stores none of its "
                                  "values, which would read as the fill value 0.0)")


def test_an_hdf5_dataset_of_chunks_never_written_is_refused(elmo_fixture_dir, tmp_path):
    weights = _weights_with_w_0(elmo_fixture_dir, tmp_path, chunks=(8, 256), fillvalue=1.5)
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(weights))
    assert str(refused.value) == (f"{weights}: tensor {_W_0!r} was never written (the file stores 1 of its 4 "
                                  "chunks; the others would read as the fill value 1.5)")


def test_an_hdf5_dataset_written_in_compressed_chunks_loads_its_values(elmo_fixture_dir, tmp_path, reference_model):
    weights = tmp_path / "weights.hdf5"
    weights.write_bytes((elmo_fixture_dir / "lm_weights.hdf5").read_bytes())
    with h5py.File(weights, "a") as f:
        values = f[_W_0][...]
        del f[_W_0]
        f.create_dataset(_W_0, data=values, chunks=(8, 64), compression="gzip")
    model = BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(weights))
    np.testing.assert_array_equal(_layers(model), _layers(reference_model))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32-be"])
def test_a_utf16_or_utf32_vocabulary_is_counted_as_its_characters(tmp_path, encoding):
    # json reads UTF-16 and 32; their bytes were counted as UTF-8's, where '•' (U+2022, bytes 22 20
    # in UTF-16LE) ended a string: the commas after it were counted as items and the file refused
    words = [f"a•,,,,{i}" for i in range(20)]
    folder = _word_model(tmp_path / "m", words)
    raw = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    (folder / "vocab.json").write_bytes(json.dumps(raw, ensure_ascii=False).encode(encoding))
    assert BiLM.from_pretrained(str(folder)).vocab.tokens == [*SPECIALS, *words]
    raw["tokens"] += [f"w{i}" for i in range(1000)]  # far longer than vocab_size says: refused unparsed
    (folder / "vocab.json").write_bytes(json.dumps(raw, ensure_ascii=False).encode(encoding))
    with pytest.raises(CheckpointError, match="holds more than the 52 items that vocab_size=23 in .*; refused unparsed"):
        BiLM.from_pretrained(str(folder))


def test_a_token_that_utf8_cannot_encode_is_named_when_saved_and_nothing_is_written(tmp_path):
    # A vocabulary built in Python with a lone surrogate ('\ud800', bytes decoded with
    # surrogateescape) failed with UnicodeEncodeError naming neither file nor token, and left the
    # folder made for it empty.
    torch.manual_seed(0)
    vocab = Vocabulary([*SPECIALS, "ok", "a\ud800b", "😀"])
    config = ElmoConfig(lstm=LstmConfig(dim=8, projection_dim=4), char_cnn=None, token_encoder="word",
                        word_embedding_dim=4, vocab_size=len(vocab))
    with pytest.raises(ValueError) as refused:
        BiLM(config, vocab).save_pretrained(str(tmp_path / "m"))
    assert str(refused.value) == "vocab.json: tokens[4] holds a lone surrogate, which no UTF-8 file can hold"
    assert not (tmp_path / "m").exists()
    vocab = Vocabulary([*SPECIALS, "ok", "😀"])  # a character past U+FFFF is saved and read back
    BiLM(config.model_copy(update={"vocab_size": 5}), vocab).save_pretrained(str(tmp_path / "m"))
    assert BiLM.from_pretrained(str(tmp_path / "m")).vocab.tokens == [*SPECIALS, "ok", "😀"]


def test_a_model_saved_where_nothing_can_be_written_is_named(tmp_path):
    # fsspec's HTTP file system writes nothing: its NotImplementedError has no message, and
    # export or import-allennlp with --output http://... said only "error: ".
    model = BiLM.from_pretrained(str(_clipped_model(tmp_path / "m")))
    server = HttpServer(tmp_path)
    try:
        with pytest.raises(OSError) as refused:
            model.save_pretrained(f"{server.url}/ok/new")
    finally:
        server.close()
    assert str(refused.value) == (f"[Errno 30] cannot write {server.url}/ok/new/model.safetensors: its file system "
                                  "does not write files")


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_a_not_implemented_error_inside_the_write_is_its_own(tmp_path, protocol):
    # 6665028 took any NotImplementedError for the file system's refusal to write; embed-file runs
    # the model inside the write, so torch's (an op a backend lacks) was reported as
    # "its file system does not write files".
    import fsspec

    from elmo_pipeline.formats.atomic import replace_atomically

    fs = fsspec.filesystem(protocol)
    final = str(tmp_path / "out.hdf5") if protocol == "file" else f"memory://{tmp_path}/out.hdf5"
    raised = NotImplementedError("the op 'aten::x' is not implemented for this backend")

    def write(partial):
        with fs.open(partial, "wb") as f:
            f.write(b"begun")
        raise raised

    with pytest.raises(NotImplementedError) as refused:
        replace_atomically(fs, final, write)
    assert refused.value is raised
    assert fs.glob(final + "*") == []  # neither the file nor its partial


def test_a_config_file_past_one_mib_is_refused_unparsed(tmp_path, elmo_fixture_dir):
    # Parsed whole before any check: a 139 MB config.json (15 million cutoffs) took 1.9 GB and 17 s
    # to be refused. Here each is valid JSON, padded past the limit with spaces.
    def padded(path: Path) -> None:
        path.write_text(path.read_text() + " " * (1 << 20))

    folder = _clipped_model(tmp_path / "m")
    padded(folder / "config.json")
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_pretrained(str(folder))
    assert str(refused.value) == (f"{folder / 'config.json'}: larger than the 1,048,576 bytes a model config may "
                                  "have; refused")
    options = tmp_path / "options.json"
    options.write_text((elmo_fixture_dir / "options.json").read_text())
    padded(options)
    with pytest.raises(CheckpointError, match=f"^{options}: larger than the 1,048,576 bytes a model config may have"):
        BiLM.from_allennlp(str(options), str(elmo_fixture_dir / "lm_weights.hdf5"))
    fml = write_model(tmp_path / "fml", network(), list("abc"), ["the"])
    padded(fml / "net.json")
    with pytest.raises(CheckpointError, match=f"^{fml / 'net.json'}: larger than the 1,048,576 bytes a model config"):
        BiLM.from_formanylangs(str(fml))


@pytest.mark.parametrize("clip", [1e5, FLOAT32_MAX])
def test_a_clip_past_a_16_bit_models_range_clips_nothing_there(clip):
    # torch refused to clamp at it ("value cannot be converted to type c10::Half without
    # overflow"): every sentence of a float16 model with a proj_clip of 1e5 failed, and under bf16
    # autocast one of 3.4e38; rounded to the dtype the clip is infinite, so nothing is clipped.
    cnn = CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 4)), n_highway=1)
    layers = {}
    for given in (clip, None):
        torch.manual_seed(0)
        model = BiLM(ElmoConfig(lstm=LstmConfig(dim=16, projection_dim=8, cell_clip=given, proj_clip=given),
                                char_cnn=cnn)).eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            layers[given, "bf16"] = model.embed(SENTENCES).layers
        with torch.no_grad():
            layers[given, "float16"] = model.half().embed(SENTENCES).layers
    for dtype in ("bf16", "float16"):
        assert torch.isfinite(layers[clip, dtype]).all()
        assert torch.equal(layers[clip, dtype], layers[None, dtype])


@pytest.mark.parametrize("zip_format", [True, False])
def test_a_pickle_whose_structure_is_past_16_mib_is_refused_before_it_is_unpickled(tmp_path, zip_format):
    # Unpickled whole, on the meta device, before its entries were checked: a list of 10 million
    # ints beside the tensors of a 50 MB token_embedder.pkl took 0.74 GB and 10 s to be refused.
    folder = write_model(tmp_path / "fml", network(), list("abc"), ["the"])
    state = torch.load(folder / "token_embedder.pkl", weights_only=True)
    torch.save({**state, "junk": "x" * (16 << 20)}, folder / "token_embedder.pkl",
               _use_new_zipfile_serialization=zip_format)
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_formanylangs(str(folder))
    assert str(refused.value) == (f"{folder / 'token_embedder.pkl'}: its pickled structure holds more than "
                                  "16,777,216 bytes, beyond a state dict's names and tensor records; refused before "
                                  "it is unpickled")


def test_a_vocab_size_the_weights_cannot_hold_is_refused_before_the_vocabulary_is_read(tmp_path):
    # vocab.json's items are counted against vocab_size before it is parsed: a config raising
    # vocab_size with it had 200,003 tokens parsed before the count was compared with the weights.
    folder = _word_model(tmp_path / "m", ["the", "cat"])
    raw = json.loads((folder / "config.json").read_text())
    raw.update(vocab_size=10_000_000, weights_sha256=None)
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "vocab.json").write_text(json.dumps({"tokens": [*SPECIALS, *(f"w{i}" for i in range(200_000))]}))
    weights = folder / "model.safetensors"
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_pretrained(str(folder))
    assert str(refused.value) == (f"{folder / 'config.json'}: vocab_size=10000000 asks for a table of 10,000,000 "
                                  f"words, more than {weights} ({weights.stat().st_size:,} bytes) can hold; refused "
                                  "before it is read")


@pytest.mark.parametrize("name", ["config.json", "net.json"])
def test_an_elmoformanylangs_folders_config_past_one_mib_is_refused_unread(tmp_path, name):
    # e9cb96b read an ELMoForManyLangs folder's config.json and network config up to the 4 GiB a
    # model file may have, then refused past 1 MiB: an 800 MB config.json took 1.0 GB and 2.1 s.
    # Sparse, 4 GiB and a byte: the limit the read was given names itself in the refusal.
    fml = write_model(tmp_path / "fml", network(), list("abc"), ["the"])
    with open(fml / name, "a") as f:
        f.truncate((4 << 30) + 1)
    with pytest.raises(CheckpointError) as refused:
        BiLM.from_formanylangs(str(fml))
    assert str(refused.value) == f"{fml / name}: larger than the 1,048,576 bytes a model config may have; refused"
