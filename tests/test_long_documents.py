"""One huge document: tokenized in pieces of PIECE_CHARS with exact offsets, and read without
keeping copies of its line. (Peak memory is measured by benchmarks/bench_memory.py.)"""

from __future__ import annotations

import sys
import tracemalloc

import pytest

from elmo_pipeline.inputs import ReadOptions, WorkItem, read_work_item
from elmo_pipeline.records import Document, Sentence
from elmo_pipeline.tokenization import PIECE_CHARS, build_nlp, tokenize_documents
from support import long_text


class CountingNlp:
    """spaCy's pipeline with its own max_length (1,000,000), counting calls and their lengths."""

    def __init__(self) -> None:
        self.nlp = build_nlp("en")
        self.max_length = self.nlp.max_length
        self.lengths: list[int] = []

    def __call__(self, text: str):
        self.lengths.append(len(text))
        return self.nlp(text)


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
