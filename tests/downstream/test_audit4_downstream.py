"""From the audit of probe, its labelled files and ParquetFeatureDataset with hostile data: train
and dev files of two formats, CoNLL-U fields that would make another label or token than the one
meant, the one-worker report, and features given in another order, damaged, holding nulls, read
with drop_last under batch_tokens, or given empty columns or flags that are not bools."""

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.cli.main import main
from elmo_pipeline.downstream.conll import ConllError, common_format, read_conllu
from elmo_pipeline.downstream.dataset import ParquetFeatureDataset, expand_sources
from elmo_pipeline.corpus.schema import OutputSpec, build_table
from support import data_path, strict_json
from test_audit3_downstream import sentence_shard
from test_downstream_dataset import make_items

ELMO = data_path("allennlp_elmo")
MODEL = f"{ELMO / 'options.json'},{ELMO / 'lm_weights.hdf5'}"


def conllu_line(number, form, upos, xpos="_"):
    return f"{number}\t{form}\t{form.lower()}\t{upos}\t{xpos}\t_\t0\troot\t_\t_\n"


def test_train_and_dev_files_of_two_formats_are_refused_before_any_work(tmp_path, capsys):
    """A CoNLL-U dev file beside a CoNLL-2003 train file was read as CoNLL-2003, the train file's
    format: its IDs were the tokens and its MISC column the labels, and every probe scored 0.00%
    (exit 0; measured on 8 EWT dev sentences, 151 tokens)."""
    train = tmp_path / "train.txt"
    train.write_text("The DET\ndog NOUN\nbarks VERB\n\nA DET\ncat NOUN\n", encoding="utf-8")
    dev = tmp_path / "dev.conllu"
    dev.write_text(conllu_line(1, "The", "DET") + conllu_line(2, "cat", "NOUN") + "\n", encoding="utf-8")
    assert common_format({"train": str(train), "train again": str(train)}) == "conll2003"
    with pytest.raises(ConllError) as caught:
        common_format({"train": str(train), "dev": str(dev)})
    assert str(caught.value) == (f"the labelled files are not of one format (train file {train} reads as conll2003, "
                                 f"dev file {dev} reads as conllu): give them in one format")
    out = tmp_path / "out"
    assert main(["probe", "--train", str(train), "--dev", str(dev), "--output", str(out), "--model", MODEL]) == 2
    assert str(caught.value) in capsys.readouterr().err
    assert not out.exists()  # before the extraction


@pytest.mark.parametrize("line, says", [
    (conllu_line(1, "dog", ""), "UPOS '' is empty"),
    (conllu_line(1, "dog", "NOUN "), "UPOS 'NOUN ' is empty or has whitespace at its start or end"),
    (conllu_line(1, "dog", "NOUN", " NN"), "XPOS ' NN' is empty or has whitespace at its start or end"),
    (conllu_line(1, " dog", "NOUN"), "FORM ' dog' has whitespace at its start or end, which CoNLL-U does not allow "
                                     "(embedded so, it is another token than 'dog')"),
])
def test_conllu_values_empty_or_with_whitespace_at_their_ends_are_refused_with_file_and_line(tmp_path, line, says):
    """Read as they were, an empty UPOS and 'NOUN ' were labels of their own beside 'NOUN' (the
    report listed ['', 'NOUN', 'NOUN ', 'VERB'] for a file of all three), and ' dog' a token of
    its own. Every column that can be the label is checked, whatever --label is: the extraction
    reads the file again without one."""
    path = tmp_path / "x.conllu"
    good = conllu_line(1, "cat", "NOUN") + conllu_line(2, "sat", "VERB") + "\n"
    path.write_text(good + line + conllu_line(2, "ran", "VERB") + "\n", encoding="utf-8")
    with pytest.raises(ConllError) as caught:
        list(read_conllu(str(path)))
    assert str(caught.value).startswith(f"{path}:4: {says}")
    for label in ("deprel", "lemma"):  # not the label in question: refused all the same
        with pytest.raises(ConllError, match=f"^{path}:4: "):
            list(read_conllu(str(path), label))
    path.write_text(good + conllu_line(1, "New York", "PROPN") + "\n", encoding="utf-8")  # a space inside: UD v2
    assert [s.tokens for s in read_conllu(str(path))] == [("cat", "sat"), ("New York",)]


def test_probe_refuses_a_label_with_whitespace_at_its_end_before_any_work(tmp_path, capsys):
    train = tmp_path / "train.conllu"
    train.write_text(conllu_line(1, "cat", "NOUN") + conllu_line(2, "sat", "VERB") + "\n"
                     + conllu_line(1, "dog", "NOUN ") + conllu_line(2, "ran", "VERB") + "\n", encoding="utf-8")
    dev = tmp_path / "dev.conllu"
    dev.write_text(conllu_line(1, "dog", "NOUN") + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["probe", "--train", str(train), "--dev", str(dev), "--output", str(out), "--model", MODEL]) == 2
    assert f"{train}:4: UPOS 'NOUN ' is empty or has whitespace" in capsys.readouterr().err
    assert not out.exists()


def test_a_file_without_a_token_line_takes_no_part_in_the_format(tmp_path, capsys):
    """An empty dev file beside CoNLL-U train named .txt was said to be of another format
    (CoNLL-2003, detect_format's default), where the refusal that fits is that it holds no labelled
    token; a first line of spaces was taken for a token line (CoNLL-2003)."""
    train = tmp_path / "train.txt"
    train.write_text("  \n" + conllu_line(1, "cat", "NOUN") + conllu_line(2, "sat", "VERB") + "\n", encoding="utf-8")
    dev = tmp_path / "dev.txt"
    dev.write_text("# nothing here\n\n", encoding="utf-8")
    assert common_format({"train": str(train), "dev": str(dev)}) == "conllu"
    assert common_format({"dev": str(dev)}) == "conll2003"  # no file tells: detect_format's default
    out = tmp_path / "out"
    assert main(["probe", "--train", str(train), "--dev", str(dev), "--output", str(out), "--model", MODEL]) == 2
    assert f"dev file {dev} has no labelled tokens" in capsys.readouterr().err


TIMINGS = {("train_seconds",), ("extraction", "seconds"), ("extraction", "tokens_per_second")}


def differing(a, b, path=()):
    """The key paths at which two reports differ."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return {p for k in a for p in differing(a[k], b[k], (*path, k))}
    return set() if a == b else {path}


def test_one_worker_gives_the_same_report_bit_for_bit_but_for_its_timings(tmp_path):
    """The README's promise for a local run of one worker: the same files and --seed, the same
    report.json (its three timings aside, which the README had not set apart), mix.json and chart."""
    train, dev = tmp_path / "train.conllu", tmp_path / "dev.conllu"
    words = [("The", "DET"), ("dog", "NOUN"), ("barks", "VERB"), ("A", "DET"), ("cat", "NOUN"), ("sleeps", "VERB")]
    train.write_text("".join("".join(conllu_line(i + 1, *words[(k + i) % 6]) for i in range(3 + k % 3)) + "\n"
                             for k in range(8)), encoding="utf-8")
    dev.write_text("".join(conllu_line(i + 1, *w) for i, w in enumerate(words)) + "\n", encoding="utf-8")
    runs = [tmp_path / "one", tmp_path / "two"]
    for out in runs:
        assert main(["probe", "--train", str(train), "--dev", str(dev), "--output", str(out), "--model", MODEL,
                     "--epochs", "2", "--threads", "1", "--seed", "7"]) == 0
    one, two = (strict_json((out / "report.json").read_text()) for out in runs)
    assert differing(one, two) <= TIMINGS and one["dev_tokens"] == 6
    assert one["accuracy"] == two["accuracy"] and one["loss_per_epoch"] == two["loss_per_epoch"]
    for name in ("mix.json", "probe.png"):
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes()


def test_the_same_files_given_in_another_order_are_read_in_the_same_order(tmp_path):
    """expand_sources kept the order the sources were given in, though it and the module say the
    files are sorted: ['b', 'a'] read b's sentences first with shuffle_buffer=0, and the same seed
    shuffled them otherwise (the file order is the first thing shuffled)."""
    spec = OutputSpec(n_layers=3, width=8, layout="sentence", dtype="float16")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(2):
            items = make_items(f"{name}{i}", 0, 3, np.random.default_rng(i))
            pq.write_table(build_table(items, spec), tmp_path / name / f"sentences-0000{i}-of-00002.parquet")
    given = [str(tmp_path / "b"), str(tmp_path / "a" / "sentences-00001-of-00002.parquet"),
             str(tmp_path / "a" / "sentences-00000-of-00002.parquet")]
    files = [f"{tmp_path}/{run}/sentences-0000{i}-of-00002.parquet" for run in "ab" for i in range(2)]
    assert expand_sources(given) == expand_sources(given[::-1]) == files
    for buffer in (0, 4):
        orders = [[sid for batch in ParquetFeatureDataset(sources, shuffle_buffer=buffer, seed=3, batch_sentences=5)
                   for sid in batch.sentence_ids] for sources in (given, given[::-1])]
        assert orders[0] == orders[1] and len(set(orders[0])) == 12
    assert orders[0] != [sid for batch in ParquetFeatureDataset(files) for sid in batch.sentence_ids]  # shuffled


@pytest.mark.parametrize("count, tokens, batch_tokens, sizes", [
    (100, 10, 100, [10] * 10),  # every batch filled by batch_tokens, the last one too: it was dropped
    (95, 10, 100, [10] * 9),  # the last batch of 5 could take a sixth: partial, dropped
    (100, 10, None, [32] * 3),  # by sentences alone, as before
    (3, 40, 100, [2]),  # a batch of 2 sentences of 40 tokens has no room for a third
])
def test_drop_last_leaves_out_a_last_batch_only_when_it_is_partial(tmp_path, count, tokens, batch_tokens, sizes):
    """drop_last counted a batch's fullness in sentences alone: under batch_tokens every batch is
    cut by tokens before it holds batch_sentences, so the last batch, as full as the others, was
    dropped and its sentences went unread every epoch (90 of 100 sentences read, measured)."""
    source = sentence_shard(tmp_path / "f", [tokens] * count)
    ds = ParquetFeatureDataset(source, batch_sentences=32, batch_tokens=batch_tokens, drop_last=True)
    assert [len(batch.sentence_ids) for batch in ds] == sizes


def test_a_row_group_that_cannot_be_read_is_named_by_file_and_row_group(tmp_path):
    """A shard whose footer reads but whose pages are damaged stopped the iteration with Arrow's
    "OSError: Couldn't deserialize thrift: ... Deserializing page header failed", naming no file
    of the folder's shards."""
    path = tmp_path / "sentences-00000-of-00001.parquet"
    pq.write_table(build_table(make_items("d", 0, 4, np.random.default_rng(0)),
                               OutputSpec(n_layers=3, width=8, layout="sentence", dtype="float16")), path)
    chunks = pq.ParquetFile(path).metadata.row_group(0)
    layer = next(chunks.column(i) for i in range(chunks.num_columns)
                 if chunks.column(i).path_in_schema.startswith("layer_1"))
    start = layer.dictionary_page_offset or layer.data_page_offset
    whole = bytearray(path.read_bytes())
    whole[start:start + 32] = bytes(range(200, 232))  # the page header of layer_1's first page
    path.write_bytes(bytes(whole))
    ds = ParquetFeatureDataset(str(tmp_path))  # the footer is whole: the files open
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} row group 0: cannot be read \(.+\)$"):
        list(ds)


def with_column(table, name, array):
    return table.set_column(table.schema.get_field_index(name), pa.field(name, array.type), array)


def null_value(fixed, at):
    """`fixed` (vectors) with value `at` of its floats null."""
    floats = fixed.values.to_numpy(zero_copy_only=False)
    return pa.FixedSizeListArray.from_arrays(pa.array(floats, fixed.type.value_type, mask=np.arange(len(floats)) == at),
                                             fixed.type.list_size)


@pytest.mark.parametrize("layout, change, says", [
    ("sentence", "null sentence", "column layer_0 holds 1 null(s)"),
    ("sentence", "null value", "column layer_1 holds 1 null(s)"),
    ("sentence", "other cuts", "column layer_2 holds other numbers of vectors per sentence than layer_0"),
    ("token", "null value", "column layer_1 holds 1 null(s)"),
])
def test_vectors_missing_or_cut_otherwise_in_a_shard_are_named(tmp_path, layout, change, says):
    """A null where extract writes vectors (a file rewritten by another tool) was read as it was:
    a null sentence was left out, unseen (5 of 6 sentences read), a null value became a NaN in the
    features, and a column cut into sentences otherwise than the first was cut at the first's."""
    spec = OutputSpec(n_layers=3, width=8, layout=layout, dtype="float16")
    table = build_table(make_items("d", 0, 6, np.random.default_rng(0)), spec)
    if change == "null sentence":
        for name in ("layer_0", "layer_1", "layer_2"):
            table = with_column(table, name, pc.if_else(pa.array([i == 2 for i in range(6)]),
                                                        pa.scalar(None, table.schema.field(name).type),
                                                        table.column(name).combine_chunks()))
    elif change == "null value":
        vectors = table.column("layer_1").combine_chunks()
        table = with_column(table, "layer_1", null_value(vectors, 5) if layout == "token" else
                            pa.ListArray.from_arrays(vectors.offsets, null_value(vectors.values, 5)))
    else:  # sentences 0 and 1 swap one vector: the same number of vectors in all
        vectors = table.column("layer_2").combine_chunks()
        offsets = vectors.offsets.to_numpy().copy()
        offsets[1] += 1 if offsets[2] - offsets[1] > 1 else -1
        table = with_column(table, "layer_2", pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), vectors.values))
    path = tmp_path / f"{layout}s-00000-of-00001.parquet"
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} row group 0: {re.escape(says)}"):
        list(ParquetFeatureDataset(str(path)))


def test_empty_columns_are_refused_as_such(tmp_path):
    """columns=[] was said to be a file of `extract --layers none` ("it has no layer_J column; name
    its mixes"), of a file holding layer_0 to layer_2 beside its mix."""
    spec = OutputSpec(n_layers=3, width=8, layout="sentence", dtype="float16", mix_names=("avg",))
    items = make_items("d", 0, 2, np.random.default_rng(0))
    items = [item._replace(mixes={"avg": item.layers.mean(0)}) for item in items]
    path = tmp_path / "sentences-00000-of-00001.parquet"
    pq.write_table(build_table(items, spec), path)
    for empty in ([], ()):
        with pytest.raises(ValueError) as caught:
            ParquetFeatureDataset(str(path), columns=empty)
        assert str(caught.value) == (f"columns is empty: name the vector columns to read ({path} has ['layer_0', "
                                     "'layer_1', 'layer_2', 'mix_avg'])")


def test_flags_that_are_not_bools_are_refused_when_given(tmp_path):
    """drop_last='no' was taken as true, and the last batch left out (3 of 4 sentences read)."""
    source = sentence_shard(tmp_path / "f", [2, 2, 2, 2])
    assert sum(len(b.sentence_ids) for b in ParquetFeatureDataset(source, batch_sentences=3, drop_last=False)) == 4
    for flag, value in (("drop_last", "no"), ("drop_last", 1), ("with_tokens", "yes"), ("with_tokens", None)):
        with pytest.raises(TypeError, match=f"^{flag} must be a bool, got {re.escape(repr(value))}$"):
            ParquetFeatureDataset(source, batch_sentences=3, **{flag: value})
