"""spaCy's tokenizer cache filled chunk by chunk: the same tokens as spaCy alone, bounded, and
safe under threads."""

from __future__ import annotations

import random

import pytest
from spacy.tokenizer import Tokenizer
from support import data_path, run_threads

from elmo_pipeline.corpus import chunk_cache
from elmo_pipeline.corpus.chunk_cache import MAX_CHUNK_CHARS, ChunkCache, fill_chunk_cache
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.corpus.tokenization import LONG_RUN_CHARS, build_nlp, make_doc, tokenize_documents

# Special cases (with and without affixes around them), affixes, URLs, e-mails, emoji, combining
# marks, every kind of whitespace spaCy cuts at, and chunks past MAX_CHUNK_CHARS and LONG_RUN_CHARS.
PIECES = [
    "don't", "(don't)", "\"can't!\"", "won't.", "I'm", "a.m.", "U.S.", "e.g.,", ":)", ":-)", "'s", "’s", "o'clock",
    "'em", "y'all", "Mr.", "vs.", "http://x.org/a?b=c", "hello@example.com", "“quoted”", "—", "...", "!!!", "(", ")",
    "'", "\"", "#tag", "@user", "1,000.00", "$5", "5%", "10:30", "ﬁne", "İstanbul", "Straße", "e\u0301", "😀", "a/b",
    "c++", "--", "\u200b", "x" * (MAX_CHUNK_CHARS + 6), "(" * 30 + "a" + ")" * 30, "y" * (LONG_RUN_CHARS + 5),
    "Apple", "apple", "the", "the.", "(the", "The",
]
SEPARATORS = [" ", " ", "", "  ", "\n", "\r\n", "\t", "\u3000", "\xa0", "\n\n"]


def hostile_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) + rng.choice(SEPARATORS) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def tokens(docs) -> list[list[tuple[str, int, bool, str]]]:
    return [[(t.text, t.idx, bool(t.is_sent_start), t.whitespace_) for t in doc] for doc in docs]


def spacy_alone(lang: str, texts: list[str]):
    """What spaCy gives without our cache filling (a pipeline of its own, fresh)."""
    return tokens(build_nlp(lang).pipe(texts))


def filled(nlp, texts: list[str], batch: int = 64):
    out = []
    for i in range(0, len(texts), batch):
        fill_chunk_cache(nlp, texts[i:i + batch])
        out += tokens(nlp.pipe(texts[i:i + batch]))
    return out


@pytest.mark.parametrize("lang", ["en", "de", "fr", "es", "ru", "tr"])
def test_the_tokens_are_spacys_own(lang):
    texts = hostile_texts(600) * 2  # the second pass reads every chunk from the cache
    nlp = build_nlp(lang)
    assert filled(nlp, texts) == spacy_alone(lang, texts)
    assert 0 < len(chunk_cache._CACHES[nlp]) <= sum(len(t.split()) for t in texts)


def test_wikitext_valid_tokens_and_sentences_are_spacys_own():
    with open(data_path("wikitext2", "wiki.valid.tokens"), encoding="utf-8") as f:
        texts = [line for line in f if line.strip()]
    nlp = build_nlp("en")
    assert filled(nlp, texts, batch=256) == spacy_alone("en", texts)
    assert len(chunk_cache._CACHES[nlp]) > 10_000


def test_tokenize_documents_fills_the_cache_and_keeps_its_sentences():
    texts = hostile_texts(200, seed=1)
    docs = [Document(f"d{i}", text, "in.txt", i + 1) for i, text in enumerate(texts)]
    nlp = build_nlp("en")
    results = tokenize_documents(nlp, docs, max_sentence_tokens=1000)
    assert len(chunk_cache._CACHES[nlp]) > 0
    alone = build_nlp("en")  # the tokens tokenize_documents makes (make_doc), without the cache
    expected = [[s for s in ([(t.text, t.idx) for t in span if not t.is_space] for span in doc.sents) if s]
                for doc in alone.pipe(make_doc(alone, text) for text in texts)]
    got = [[list(zip(s.tokens, s.char_starts.tolist())) for s in result] for result in results]
    assert got == expected


def test_a_long_document_fills_the_cache_piece_by_piece(monkeypatch):
    from elmo_pipeline.corpus import tokenization
    monkeypatch.setattr(tokenization, "PIECE_CHARS", 2000)
    text = " ".join(hostile_texts(60, seed=2))
    nlp = build_nlp("en")
    sentences = list(tokenize_documents(nlp, [Document("long", text, "in.txt", 1)], 1000)[0])
    assert len(chunk_cache._CACHES[nlp]) > 0
    for s in sentences:
        assert [text[a:b] for a, b in zip(s.char_starts, s.char_ends)] == list(s.tokens)


def test_the_set_stops_at_its_bound_and_long_chunks_are_left_to_spacy():
    texts = hostile_texts(300, seed=3)
    nlp = build_nlp("en")
    cache = chunk_cache._CACHES[nlp] = ChunkCache(nlp.tokenizer, max_chunks=25)
    assert filled(nlp, texts) == spacy_alone("en", texts)
    assert len(cache) == 25
    unbounded = ChunkCache(build_nlp("en").tokenizer)
    unbounded.fill(texts)
    chunks = {c for t in texts for c in t.split()}
    assert len(unbounded) == len({c for c in chunks if len(c) <= MAX_CHUNK_CHARS}) < len(chunks)


def test_spacys_cache_gets_room_for_the_chunks():
    tokenizer = build_nlp("en").tokenizer
    tokenizer.max_cache_size = 100
    ChunkCache(tokenizer, max_chunks=1000)
    assert tokenizer.max_cache_size == 1000 + chunk_cache.SPACY_CACHE_ROOM
    tokenizer.max_cache_size = 10**7  # a larger limit set by the user stays
    ChunkCache(tokenizer, max_chunks=1000)
    assert tokenizer.max_cache_size == 10**7


def test_other_tokenizers_are_left_alone():
    chinese = build_nlp("zh", segmenter="char")
    fill_chunk_cache(chinese, ["今天 天气 很好"])
    assert chinese not in chunk_cache._CACHES

    class Custom(Tokenizer):
        pass

    nlp = build_nlp("en")
    old = nlp.tokenizer
    nlp.tokenizer = Custom(nlp.vocab, old.rules, old.prefix_search, old.suffix_search, old.infix_finditer,
                           old.token_match, old.url_match)
    fill_chunk_cache(nlp, ["don't stop"])
    assert nlp not in chunk_cache._CACHES


def test_a_replaced_tokenizer_gets_a_cache_of_its_own():
    nlp = build_nlp("en")
    fill_chunk_cache(nlp, ["one two"])
    first = chunk_cache._CACHES[nlp]
    nlp.tokenizer = build_nlp("en").tokenizer
    fill_chunk_cache(nlp, ["three"])
    second = chunk_cache._CACHES[nlp]
    assert second is not first and second.tokenizer is nlp.tokenizer and len(second) == 1


@pytest.mark.parametrize("shared", [True, False], ids=["one pipeline", "a pipeline each"])
def test_threads_get_spacys_tokens(shared):
    texts = hostile_texts(400, seed=4)
    expected = spacy_alone("en", texts)
    one = build_nlp("en")
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            order = list(range(len(texts)))
            random.Random(k).shuffle(order)
            nlp = one if shared else build_nlp("en")
            got = {}
            for i in range(0, len(order), 16):
                batch = order[i:i + 16]
                fill_chunk_cache(nlp, [texts[j] for j in batch])
                for j, doc in zip(batch, nlp.pipe([texts[j] for j in batch])):
                    got[j] = tokens([doc])[0]
            results[k] = [got[j] for j in range(len(texts))]
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    run_threads(work, 4)
    assert not errors
    assert all(results[k] == expected for k in range(4))
