"""Tokens are never cut inside a grapheme cluster (corpus/graphemes.py, tokenization.make_doc)."""

import unicodedata

import numpy as np
import pytest

from elmo_pipeline.corpus.graphemes import inside_clusters
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.corpus.tokenization import build_nlp, make_doc, tokenize_documents

FAMILY = "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466"  # man ZWJ woman ZWJ girl ZWJ boy
THUMB = "\U0001F44D\U0001F3FD"  # thumbs up, skin tone 4
FR, DE, JP = "\U0001F1EB\U0001F1F7", "\U0001F1E9\U0001F1EA", "\U0001F1EF\U0001F1F5"
TECHNOLOGIST = "\U0001F468\u200d\U0001F4BB"
KEYCAP = "#\ufe0f\u20e3"
CAFE = unicodedata.normalize("NFD", "café")  # "e" and U+0301


def clusters(text: str) -> list[str]:
    """`text` cut at every index that `inside_clusters` leaves as a boundary."""
    cuts = np.arange(1, len(text), dtype=np.int64)
    pieces, start = [], 0
    for cut, inside in zip(cuts.tolist(), inside_clusters(text, cuts).tolist()):
        if not inside:
            pieces.append(text[start:cut])
            start = cut
    return pieces + [text[start:]]


def test_grapheme_clusters_follow_unicode_rules():
    assert clusters(f"x{FAMILY}{FR}{DE}\U0001F1EF{THUMB}.") == ["x", FAMILY, FR, DE, "\U0001F1EF", THUMB, "."]
    han = unicodedata.normalize("NFD", "한")  # three conjoining jamo
    assert len(han) == 3 and clusters(CAFE + han + han) == ["c", "a", "f", CAFE[3:], han, han]
    assert clusters("क्षत्रिय") == ["क्", "ष", "त्", "रि", "य"]  # virama and vowel signs stay with their letter
    assert clusters("\u202b\u0301a\u200d.") == ["\u202b", "\u0301", "a\u200d", "."]  # none after a bidi control
    assert clusters("plain ascii") == list("plain ascii")


@pytest.mark.parametrize("lang", ["en", "xx"])
def test_spacy_does_not_cut_emoji_apart(lang):
    """spaCy's affix rules split every emoji off: a skin tone and the members of a family became
    tokens of their own, the zero-width joiners too, and flags their regional indicators (France
    and Germany read "\U0001F1EB", "\U0001F1F7\U0001F1E9" (Rwanda's pair), ... to a reader of the tokens)."""
    text = f"Hi {THUMB} ({FAMILY}) {FR}{DE}{JP} ok {TECHNOLOGIST} {KEYCAP}"
    (sentences,) = tokenize_documents(build_nlp(lang), [Document("d", text, "src", 1)])
    assert [t for s in sentences for t in s.tokens] == ["Hi", THUMB, "(", FAMILY, ")", FR, DE, JP, "ok",
                                                         TECHNOLOGIST, KEYCAP]
    for s in sentences:
        assert [text[a:b] for a, b in zip(s.char_starts.tolist(), s.char_ends.tolist())] == list(s.tokens)


@pytest.mark.parametrize("segmenter", ["jieba", "char"])
def test_chinese_segmenters_keep_marks_with_their_letters(segmenter):
    """Both cut before combining marks and vowel signs: "cafe" and U+0301, "क" and its virama
    (jieba cut "क्ष" at each letter too, as it cuts any word outside ASCII and ideographs)."""
    text = f"我爱{FAMILY}和{FR}。{CAFE} क्ष"
    (sentences,) = tokenize_documents(build_nlp("zh", segmenter=segmenter), [Document("d", text, "src", 1)])
    tokens = [t for s in sentences for t in s.tokens]
    assert tokens[:6] == ["我", "爱", FAMILY, "和", FR, "。"]
    assert tokens[6:] == ([CAFE, "क्ष"] if segmenter == "jieba" else ["c", "a", "f", CAFE[3:], "क्", "ष"])


def test_joined_tokens_keep_the_rest_of_the_document_as_it_was():
    nlp = build_nlp("en")
    doc = make_doc(nlp, f"I don't like {THUMB} it's.")
    assert [(t.text, t.norm_, t.whitespace_) for t in doc] == [
        ("I", "i", " "), ("do", "do", ""), ("n't", "not", " "), ("like", "like", " "), (THUMB, THUMB, " "),
        ("it", "it", ""), ("'s", "'s", ""), (".", ".", "")]
    assert doc.text == f"I don't like {THUMB} it's."


def test_a_long_document_of_clusters_is_joined_in_pieces():
    """By characters, each decomposed letter is two tokens to join: 2 * 70,000 characters, cut
    into two pieces, give 70,000 tokens of two characters (spaCy's retokenizer took minutes)."""
    text = CAFE[3:] * 70_000  # "e" and U+0301
    nlp = build_nlp("zh", segmenter="char")
    (result,) = tokenize_documents(nlp, [Document("d", text, "src", 1)], max_sentence_tokens=100_000)
    tokens = [t for s in result for t in s.tokens]
    assert len(tokens) == 70_000 and set(tokens) == {CAFE[3:]}


def test_a_whitespace_free_run_longer_than_a_piece_is_cut_between_clusters():
    """A run without whitespace over a piece's length (a token of its own, in two) was cut where
    the limit fell: here between a letter and its second mark."""
    nlp = build_nlp("en")
    nlp.max_length = 1000  # pieces of at most 1000 characters, not a multiple of 3
    letter = "e\u0301\u0302"  # one cluster of three characters
    text = letter * 700
    (result,) = tokenize_documents(nlp, [Document("d", text, "src", 1)])
    tokens = [t for s in result for t in s.tokens]
    assert "".join(tokens) == text and [len(t) for t in tokens] == [999, 999, 102]


@pytest.mark.parametrize("lang", ["en", "xx", "ar"])
def test_a_period_after_a_mark_or_skin_tone_ends_the_sentence(lang):
    """spaCy splits a final period off after a letter, digit or punctuation only: "👍🏽.", "❤️." (a
    variation selector) and "café\u0301." were one token, and no sentence ended there."""
    heart = "\u2764\ufe0f"
    text = f"Great job {THUMB}. Love {heart}. Voilà café\u0301. e.g. U.S.A. ok."
    (sentences,) = tokenize_documents(build_nlp(lang), [Document("d", text, "src", 1)])
    assert [s.tokens for s in sentences][:3] == [("Great", "job", THUMB, "."), ("Love", heart, "."),
                                                 ("Voilà", "café\u0301", ".")]
    for s in sentences:
        assert [text[a:b] for a, b in zip(s.char_starts.tolist(), s.char_ends.tolist())] == list(s.tokens)


@pytest.mark.parametrize("lang, segmenter", [("en", None), ("zh", "char")])
def test_a_mark_after_whitespace_is_not_joined_to_the_whitespace(lang, segmenter):
    """A space and a mark after it are one cluster to Unicode: after two spaces (the second a
    token of whitespace), or after bidi controls read as spaces, the mark was joined to that
    whitespace, and a token held a space where the text held U+2066."""
    text = "a  \u0301b c\u202b\u2066\u0963x"
    (sentences,) = tokenize_documents(build_nlp(lang, segmenter=segmenter), [Document("d", text, "src", 1)])
    tokens = [t for s in sentences for t in s.tokens]
    assert tokens == (["a", "\u0301b", "c", "\u0963x"] if lang == "en" else ["a", "\u0301", "b", "c", "\u0963", "x"])
    for s in sentences:
        assert [text[a:b] for a, b in zip(s.char_starts.tolist(), s.char_ends.tolist())] == list(s.tokens)
