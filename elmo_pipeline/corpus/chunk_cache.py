"""spaCy's tokenizer cache, filled a chunk at a time so that documents find their chunks in it.

spaCy's Tokenizer cuts a text at whitespace into chunks and splits each chunk with regular
expressions (prefixes, suffixes, infixes); it keeps each chunk's split in a cache, so a chunk
seen before costs a lookup. But once a document meets a special case (an exception such as
"don't", "a.m." or ":)"), spaCy stores nothing more for the rest of that document, and most
sentences of English prose hold one: on WikiText-2 the regular expressions took about 3/4 of
the tokenizer's time. Tokenizing each new chunk once on its own stores its split, and the
document's own call then finds it. The tokens do not change: a chunk's split never depends on
the text around it, spaCy's own entry is what it stores, a chunk that holds a special case is
still never stored, and the special-case pass over the whole document runs as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from spacy.language import Language
from spacy.tokenizer import Tokenizer

# Chunks tokenized alone, per tokenizer: the frequent words of a corpus come early, and past
# this many nothing more is added (memory; see the README's figures).
MAX_CHUNKS = 1 << 16
# What spaCy 3.8 stores besides (its default limit): the splits the documents' own calls store.
SPACY_CACHE_ROOM = 10_000
# A longer chunk (a URL, a run of symbols) seldom comes again: it is left to the document's call.
MAX_CHUNK_CHARS = 64


class ChunkCache:
    """The chunks of one spaCy tokenizer that were tokenized alone (at most `max_chunks`)."""

    def __init__(self, tokenizer: Tokenizer, max_chunks: int = MAX_CHUNKS) -> None:
        self.tokenizer = tokenizer
        self.max_chunks = max_chunks
        self._seen: set[str] = set()
        # spaCy 3.8 stores at most SPACY_CACHE_ROOM splits (3.7 had no limit): room for these too
        room = max_chunks + SPACY_CACHE_ROOM
        if getattr(tokenizer, "max_cache_size", room) < room:
            tokenizer.max_cache_size = room

    def __len__(self) -> int:
        return len(self._seen)

    def fill(self, texts: Iterable[str]) -> None:
        """Tokenizes alone, once, each chunk of `texts` not seen before, until the set is full."""
        seen, tokenize = self._seen, self.tokenizer
        for text in texts:
            if len(seen) >= self.max_chunks:
                return
            for chunk in text.split():  # spaCy cuts at the same characters (str.isspace)
                if chunk not in seen and len(chunk) <= MAX_CHUNK_CHARS:
                    if len(seen) >= self.max_chunks:
                        return
                    seen.add(chunk)
                    tokenize(chunk)


_CACHES: weakref.WeakKeyDictionary[Language, ChunkCache] = weakref.WeakKeyDictionary()


def fill_chunk_cache(nlp: Language, texts: Iterable[str]) -> None:
    """Stores in `nlp`'s tokenizer the split of every new chunk of `texts`, before `nlp` reads
    them (see the module docstring). Anything but a spaCy pipeline with spaCy's own rule-based
    tokenizer (the Chinese segmenters, a subclass, an object that only acts as a pipeline) is
    left alone."""
    tokenizer = getattr(nlp, "tokenizer", None) if isinstance(nlp, Language) else None
    if type(tokenizer) is not Tokenizer:
        return
    cache = _CACHES.get(nlp)
    if cache is None or cache.tokenizer is not tokenizer:  # new, or the pipeline's tokenizer was replaced
        cache = _CACHES[nlp] = ChunkCache(tokenizer)
    cache.fill(texts)
