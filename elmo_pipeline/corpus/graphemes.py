"""Where a text may be cut between two tokens without cutting a grapheme cluster: what a reader
sees as one character (a letter and its combining marks, a Devanagari consonant and its vowel
sign, an emoji and its skin tone, a family joined by zero-width joiners, a flag).

spaCy's affix rules split emoji apart ("👍🏽" became "👍" and "🏽", a flag its two regional
indicators), and the Chinese segmenters cut before combining marks and vowel signs ("e" and
U+0301 of a decomposed "é"). The rules here are Unicode's extended grapheme cluster boundaries
(UAX #29) as far as `unicodedata` knows them, without an extra package: no cut after a jamo
that a Hangul syllable goes on from (GB6-GB8), before a mark, a zero-width joiner or non-joiner,
an emoji modifier or a tag character (GB9, GB9a; Thai and Lao AM count as spacing marks), after
a zero-width joiner before a pictographic symbol (GB11, with "pictographic" as emoji blocks and
other symbols), or between the two regional indicators of a flag (GB12, GB13); always a cut
after a control or format character (GB4). Prepend characters (GB9b: a few Arabic and Brahmi
signs written before their letter) are not handled.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata

import numpy as np

_ZWJ = 0x200D
_ZWNJ = 0x200C
_REGIONAL_INDICATORS = (0x1F1E6, 0x1F1FF)
_EMOJI_MODIFIERS = (0x1F3FB, 0x1F3FF)
_TAGS = (0xE0020, 0xE007F)
# extenders outside the mark categories: Thai and Lao AM (spacing marks), halfwidth kana sound marks
_OTHER_EXTENDERS = (0x0E33, 0x0EB3, 0xFF9E, 0xFF9F)
# conjoining jamo: leading consonants, vowels, trailing consonants (both blocks each)
_JAMO_L = ((0x1100, 0x115F), (0xA960, 0xA97C))
_JAMO_V = ((0x1160, 0x11A7), (0xD7B0, 0xD7C6))
_JAMO_T = ((0x11A8, 0x11FF), (0xD7CB, 0xD7FB))
_SYLLABLES = (0xAC00, 0xD7A3)


def _jamo_kind(code: int) -> str | None:
    """"L", "V", "T", "LV" or "LVT" for a Hangul jamo or precomposed syllable; None otherwise."""
    for kind, ranges in (("L", _JAMO_L), ("V", _JAMO_V), ("T", _JAMO_T)):
        if any(low <= code <= high for low, high in ranges):
            return kind
    if _SYLLABLES[0] <= code <= _SYLLABLES[1]:
        return "LV" if (code - _SYLLABLES[0]) % 28 == 0 else "LVT"
    return None


# which kinds of jamo a syllable goes on with after each kind (GB6, GB7, GB8)
_JAMO_JOINS = {"L": {"L", "V", "LV", "LVT"}, "LV": {"V", "T"}, "V": {"V", "T"}, "LVT": {"T"}, "T": {"T"}}

# what a code point can do, as bits of `_flags()`
_EXTENDS = 1  # joins the cluster before it whatever that is (GB9, GB9a)
_LEADS = 2  # the next character may join it: a zero-width joiner, a jamo or syllable
_INDICATOR = 4  # a regional indicator: half a flag


@functools.cache
def _flags() -> np.ndarray:
    """The bits above for every code point, built once per process (0.2 s) when a text first
    needs them: unicodedata has no lookup by range, and numpy then tests all cuts at once."""
    flags = np.zeros(sys.maxunicode + 1, np.uint8)
    flags[[code for code in range(sys.maxunicode + 1) if unicodedata.category(chr(code))[0] == "M"]] = _EXTENDS
    for low, high in (_EMOJI_MODIFIERS, _TAGS):
        flags[low:high + 1] = _EXTENDS
    flags[[_ZWNJ, *_OTHER_EXTENDERS]] = _EXTENDS
    flags[_ZWJ] = _EXTENDS | _LEADS
    for low, high in (*_JAMO_L, *_JAMO_V, *_JAMO_T, _SYLLABLES):
        flags[low:high + 1] |= _LEADS
    flags[_REGIONAL_INDICATORS[0]:_REGIONAL_INDICATORS[1] + 1] = _INDICATOR
    return flags


@functools.cache
def extender_class() -> str:
    """A regular expression's character class of every character that joins the cluster before
    it (marks, variation selectors, skin tones, joiners, tags)."""
    extends = np.append(_flags() & _EXTENDS != 0, False).astype(np.int8)
    edges = np.flatnonzero(np.diff(extends, prepend=0)).reshape(-1, 2)  # [first, end) of each range
    return "[" + "".join(f"{re.escape(chr(low))}-{re.escape(chr(end - 1))}" for low, end in edges.tolist()) + "]"


def code_points(text: str) -> np.ndarray:
    """The code point of each character of `text` (a lone surrogate's too)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


def may_cut_clusters(text: str) -> bool:
    """Whether `text` holds a grapheme cluster of more than one character: else a tokenizer
    cannot cut one, and `inside_clusters` need not look."""
    return not text.isascii() and bool(_flags()[code_points(text)].any())


def _joined(before: str, after: str) -> bool:
    """Whether `after` belongs to the cluster of `before`, by the rules that look at these two
    characters alone (all but the flags')."""
    flags = _flags()
    if unicodedata.category(before) in ("Cc", "Cf", "Zl", "Zp") and not flags[ord(before)] & _EXTENDS:
        return False  # GB4 (the joiners and tag characters are format characters that extend)
    if _jamo_kind(ord(after)) in _JAMO_JOINS.get(_jamo_kind(ord(before)) or "", ()):
        return True
    if flags[ord(after)] & _EXTENDS:
        return True
    return ord(before) == _ZWJ and (0x1F000 <= ord(after) <= 0x1FAFF or unicodedata.category(after) == "So")


def _between_indicators(codes: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Which cuts fall between the two regional indicators of a flag: they pair from the start of
    their run, so a cut after an odd count of them is inside one (GB12, GB13). Counted for the
    whole text at once: one cut at a time, a long run of them would take quadratic time."""
    indicators = (_flags()[codes] & _INDICATOR) != 0
    positions = np.arange(len(codes))
    last_other = np.maximum.accumulate(np.where(indicators, -1, positions))  # the last non-indicator so far
    run_before = cuts - 1 - last_other[cuts - 1]
    return indicators[cuts - 1] & indicators[cuts] & (run_before % 2 == 1)


def inside_clusters(text: str, cuts: np.ndarray) -> np.ndarray:
    """A flag per cut of `cuts` (int64 indices from 1 to len(text) - 1): whether cutting `text`
    there splits a grapheme cluster. Numpy sets aside the cuts before a character that starts a
    cluster whatever precedes it (nearly all of them in most text), and only the rest are looked
    at one by one."""
    if text.isascii() or not len(cuts):
        return np.zeros(len(cuts), bool)
    flags = _flags()
    codes = code_points(text)
    before, after = flags[codes[cuts - 1]], flags[codes[cuts]]
    inside = (_between_indicators(codes, cuts) if (after & _INDICATOR).any() else np.zeros(len(cuts), bool))
    maybe = ~inside & (((after & _EXTENDS) | (before & _LEADS)) != 0)
    inside[maybe] = [_joined(text[i - 1], text[i]) for i in cuts[maybe].tolist()]
    return inside


# How far back `cluster_start` looks: a longer cluster (a letter under a hundred marks) is cut.
_LONGEST_CLUSTER = 64


def cluster_start(text: str, i: int, lowest: int) -> int:
    """The last index from `lowest` + 1 to `i` (below len(text)) where `text` may be cut without
    splitting a grapheme cluster; `i` itself when there is none within _LONGEST_CLUSTER of it."""
    first = max(lowest, i - _LONGEST_CLUSTER)
    while first > lowest and _flags()[ord(text[first - 1])] & _INDICATOR:  # flags pair from their run's start
        first -= 1
    cuts = np.arange(1, i - first + 1, dtype=np.int64)
    whole = cuts[~inside_clusters(text[first:i + 1], cuts)]
    return first + int(whole[-1]) if len(whole) else i
