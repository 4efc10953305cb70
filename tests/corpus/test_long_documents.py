"""One huge document: tokenized in pieces of PIECE_CHARS with exact offsets, read without keeping
copies of its line, and the heap's free pages handed back. (Peak memory is measured by
benchmarks/bench_memory.py.)"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elmo_pipeline import runtime
from elmo_pipeline.corpus.byte_ranges import WorkItem
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import read_work_item
from elmo_pipeline.corpus.records import Document, EmbeddedSentence, Sentence
from elmo_pipeline.corpus.schema import OutputSpec
from elmo_pipeline.corpus.tokenization import PIECE_CHARS, build_nlp, tokenize_documents
from elmo_pipeline.transforms.write import ArrowTableCoder, WriteParquet
from support import long_text, strict_json


class CountingNlp:
    """spaCy's pipeline with its own max_length (1,000,000), counting calls and their lengths."""

    def __init__(self) -> None:
        self.nlp = build_nlp("en")
        self.max_length = self.nlp.max_length
        self.lengths: list[int] = []

    def __getattr__(self, name: str):  # make_doc, tokenizer: spaCy's
        return getattr(self.nlp, name)

    def __call__(self, doc):  # the tokens of one piece, from make_doc
        self.lengths.append(len(doc.text))
        return self.nlp(doc)


def one_call_reference(text: str, max_tokens: int) -> list[tuple]:
    """(sentence_index, window_index, tokens, starts) from ONE spaCy call on the whole text."""
    parsed = build_nlp("en")(text)
    out, index = [], 0
    for span in parsed.sents:
        tokens = [t for t in span if not t.is_space]
        if not tokens:
            continue
        for window, lo in enumerate(range(0, len(tokens), max_tokens)):
            part = tokens[lo:lo + max_tokens]
            out.append((index, window, tuple(t.text for t in part), [t.idx for t in part]))
        index += 1
    return out


@pytest.mark.parametrize("max_tokens", [7, 256])
def test_long_single_line_document_is_tokenized_in_pieces_with_exact_offsets(max_tokens):
    text = long_text(2 * PIECE_CHARS + 12_345, seed=11)
    assert "\n" not in text and len(text) < build_nlp("en").max_length  # spaCy alone would take it whole
    nlp = CountingNlp()
    (result,) = tokenize_documents(nlp, [Document("doc", text, "src", 1)], max_tokens)
    first = next(result)  # lazily: only the first piece is parsed so far
    assert nlp.lengths == [pytest.approx(PIECE_CHARS, abs=200)]
    sentences: list[Sentence] = [first, *result]
    assert len(nlp.lengths) >= 3 and max(nlp.lengths) <= PIECE_CHARS

    for s in sentences:
        assert s.doc_id == "doc"
        assert [text[a:b] for a, b in zip(s.char_starts.tolist(), s.char_ends.tolist())] == list(s.tokens)
    got = [(s.sentence_index, s.window_index, s.tokens, s.char_starts.tolist()) for s in sentences]
    assert got == one_call_reference(text, max_tokens)
    assert max_tokens == 256 or any(s.window_index > 0 for s in sentences)


@pytest.mark.parametrize("separator", ["\u2028", "\u202f", "\x85", "\u2003"])
def test_pieces_are_cut_at_any_whitespace_spacy_splits_at(separator):
    """Words apart by U+2028 (or U+202F, ...): the piece was cut at the last plain space, after a
    sentence's final period, so the next sentence ran on into it and two sentences became one."""
    words = [f"w{i}x" for i in range(40_000)]
    text = separator.join(words[:20_000]) + ". " + separator.join(words[20_000:]) + "."
    assert len(text) > PIECE_CHARS
    (result,) = tokenize_documents(build_nlp("en"), [Document("doc", text, "src", 1)], 256)
    got = [(s.sentence_index, s.window_index, s.tokens, s.char_starts.tolist()) for s in result]
    assert got == one_call_reference(text, 256)
    assert len({key[0] for key in got}) == 2


def test_a_long_line_is_not_held_twice_while_its_document_is_processed(tmp_path):
    text = long_text(3 * 2**20, seed=12)
    path = tmp_path / "one-line.txt"
    path.write_text(text + "\n", encoding="utf-8")
    tracemalloc.start()
    try:
        records = read_work_item(WorkItem(str(path)), ReadOptions())
        document = next(records)  # what the reader holds now stays held while the document goes downstream
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert document.text == text
    # the document's own text, and no copy of the line's 3+ MB of bytes beside it
    assert held - sys.getsizeof(document.text) < 2**20


# In a fresh process: what earlier tests left in this one's heap would blur the figure.
_FRAGMENTED_HEAP = """
import ctypes, os
from elmo_pipeline.runtime import release_free_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

blocks = [libc.malloc(64 * 1024) for _ in range(3200)]  # 200 MiB in the heap (below the mmap threshold)
for block in blocks:
    ctypes.memset(block, 1, 64 * 1024)
for block in blocks[::2]:  # every other one goes: free() alone cannot give back pages between live blocks
    libc.free(block)
before = resident()
print(release_free_heap(), before - resident())
"""


@pytest.mark.skipif(runtime._MALLOC_TRIM is None, reason="no glibc malloc_trim here")
def test_free_heap_pages_go_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, timeout=120)
    released, freed_bytes = out.stdout.split()
    assert released == "True" and int(freed_bytes) > 64 * 2**20, out.stderr[-2000:]


def test_row_group_tables_are_sized_without_being_pickled():
    """Beam measures the first elements of every PCollection with its coder: a row group's table
    (64 MiB) must be measured by its byte count, not serialized to be measured."""
    # float16 from numpy, as the writer makes it: pyarrow 16 (the lowest allowed) takes no Python float as one
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(np.array([0.5, -0.0, 1.0, 2.0], np.float16)), 2)
    table = pa.table({"token": ["a", "bb"], "layer_2": vectors}, metadata={b"elmo_pipeline": b'{"dtype": "float16"}'})
    assert table.schema.field("layer_2").type == pa.list_(pa.float16(), 2)
    coder = beam.coders.registry.get_coder(pa.Table)
    assert isinstance(coder, ArrowTableCoder) and coder.estimate_size(table) == table.nbytes
    back = coder.decode(coder.encode(table))
    assert back.equals(table) and back.schema.metadata == table.schema.metadata


@pytest.mark.parametrize("layout", ["token", "sentence"])
def test_vector_columns_are_written_plain_and_keys_with_a_dictionary(tmp_path, layout):
    rng = np.random.default_rng(0)
    items = []
    for i, n in enumerate([3, 1, 5]):
        starts = np.arange(n, dtype=np.int64) * 2
        items.append(EmbeddedSentence(Sentence("d", i, 0, ("w",) * n, starts, starts + 1),
                                      rng.normal(size=(3, n, 4)).astype(np.float32), {}))
    spec = OutputSpec(n_layers=3, width=4, layout=layout, metadata={"dtype": "float16"})
    with beam.Pipeline(runner="FnApiRunner") as p:
        _ = p | beam.Create(items) | WriteParquet(str(tmp_path), spec)
    (path,) = tmp_path.glob(f"{layout}s-*.parquet")
    group = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {group.column(i).path_in_schema.split(".")[0]: group.column(i).encodings
                 for i in range(group.num_columns)}
    for name, used in encodings.items():
        assert ("RLE_DICTIONARY" in used) == (not name.startswith("layer_")), (name, used)
    table = pq.read_table(path)
    assert strict_json(table.schema.metadata[b"elmo_pipeline"]) == {"dtype": "float16"}
    order = ["sentence_index", "token_index"] if layout == "token" else ["sentence_index"]
    stored = table.sort_by([(name, "ascending") for name in order]).column("layer_2").combine_chunks()
    if layout == "sentence":
        stored = stored.flatten()
    got = stored.flatten().to_numpy(zero_copy_only=False).reshape(-1, 4)
    want = np.concatenate([e.layers[2] for e in items]).astype(np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
