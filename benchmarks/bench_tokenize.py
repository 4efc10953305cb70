"""spaCy's tokenizer with and without its cache filled chunk by chunk (`corpus/chunk_cache.py`).

    python -m benchmarks.bench_tokenize [--repeats 2]

For each corpus, in the same process, alternating: the seconds of a fresh blank English
pipeline (`build_nlp("en")`, as the tokenize stage builds it) over the documents in batches of
256, once as spaCy alone and once with `fill_chunk_cache` before each batch as the stage does,
the faster of `--repeats` runs each; and whether every token (text, offset, sentence start,
trailing whitespace) is the same. The corpora: WikiText-2 train (a paragraph a document), the
sentences of UD English EWT train (a sentence a document), and a worst case of words never seen
twice (300,000 random lower-case words, a special case at the end of every 100). Then the
memory the cache holds at its bound: the growth of this process's resident memory over 200,000
new words with and without the filling, each in a child process of its own. Last, the whole
tokenize stage (`tokenize_documents`: the cache, grapheme clusters, sentences and their records)
over WikiText-2 train, in microseconds per token, the faster of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import subprocess
import sys
import time
from collections.abc import Callable

from benchmarks.common import shared_data_dir
from elmo_pipeline.corpus.chunk_cache import MAX_CHUNKS, fill_chunk_cache
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.corpus.tokenization import build_nlp, tokenize_documents

BATCH = 256


def tokenize(texts: list[str], fill: bool, keep: bool) -> list | None:
    """`texts` through a fresh blank English pipeline in batches of BATCH, its cache filled before
    each batch when `fill` (as the tokenize stage does); each document's tokens when `keep`."""
    nlp, out = build_nlp("en"), []
    for lo in range(0, len(texts), BATCH):
        batch = texts[lo:lo + BATCH]
        if fill:
            fill_chunk_cache(nlp, batch)
        for doc in nlp.pipe(batch, batch_size=BATCH):
            if keep:
                out.append([(t.text, t.idx, bool(t.is_sent_start), t.whitespace_) for t in doc])
    return out if keep else None


def random_words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 12))) for _ in range(n)]


def corpora() -> dict[str, Callable[[], list[str]]]:
    data = shared_data_dir()

    def wikitext() -> list[str]:
        with open(data / "wikitext2" / "wiki.train.tokens", encoding="utf-8") as f:
            return [line for line in f if line.strip()]

    def ewt() -> list[str]:
        with open(data / "ud_english_ewt" / "en_ewt-ud-train.conllu", encoding="utf-8") as f:
            return [line[len("# text = "):].rstrip("\n") for line in f if line.startswith("# text = ")]

    def new_words() -> list[str]:
        words = random_words(300_000)
        return [" ".join(words[i:i + 100]) + " don't." for i in range(0, len(words), 100)]

    return {"WikiText-2 train": wikitext, "UD EWT train sentences": ewt, "words never seen twice": new_words}


def timing(name: str, texts: list[str], repeats: int) -> dict:
    plain, filled = [], []
    for _ in range(repeats):
        for fill, seconds in ((False, plain), (True, filled)):
            start = time.perf_counter()
            tokenize(texts, fill, keep=False)
            seconds.append(time.perf_counter() - start)
    same = tokenize(texts, False, keep=True) == tokenize(texts, True, keep=True)
    n = sum(len(t) for t in texts)
    row = {"corpus": name, "documents": len(texts), "characters": n, "spacy_s": min(plain),
           "filled_s": min(filled), "same_tokens": same}
    print(f"  {name:<24} {len(texts):>7,} docs {min(plain):8.2f} s {min(filled):8.2f} s "
          f"{min(plain) / min(filled):6.2f}x  same tokens: {same}", flush=True)
    return row


def stage_timing(texts: list[str], repeats: int) -> dict:
    """The tokenize stage's own function over `texts` (one document each), batches of BATCH."""
    docs = [Document(f"d{i}", text, "bench", i + 1) for i, text in enumerate(texts)]
    nlp, seconds, tokens = build_nlp("en"), [], 0
    for _ in range(repeats):
        start, tokens = time.perf_counter(), 0
        for lo in range(0, len(docs), BATCH):
            for result in tokenize_documents(nlp, docs[lo:lo + BATCH]):
                tokens += sum(len(sentence.tokens) for sentence in result)
        seconds.append(time.perf_counter() - start)
    row = {"documents": len(docs), "tokens": tokens, "seconds": min(seconds),
           "us_per_token": min(seconds) / tokens * 1e6}
    print(f"tokenize stage (tokenize_documents), WikiText-2 train: {tokens:,} tokens in {row['seconds']:.2f} s, "
          f"{row['us_per_token']:.2f} us/token", flush=True)
    return row


def memory_growth(fill: bool) -> float:
    """MiB of resident memory a child process gains tokenizing 200,000 new words."""
    code = (
        "import sys\n"
        "from benchmarks.bench_tokenize import random_words, tokenize\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20\n"
        "words = random_words(200_000, seed=1)\n"
        "texts = [' '.join(words[i:i + 100]) for i in range(0, len(words), 100)]\n"
        "before = rss()\n"
        f"tokenize(texts, {fill}, keep=False)\n"
        "print(rss() - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way, the fastest counting (>= 1)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    a = parser.parse_args(argv)
    if a.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {a.repeats}")
    print(f"blank English pipeline, batches of {BATCH} documents; spaCy alone, then with the cache filled")
    loaded = {name: load() for name, load in corpora().items()}
    rows = [timing(name, texts, a.repeats) for name, texts in loaded.items()]
    growth = {"spacy_mib": memory_growth(False), "filled_mib": memory_growth(True), "max_chunks": MAX_CHUNKS}
    print(f"resident memory gained over 200,000 new words: spaCy alone {growth['spacy_mib']:.1f} MiB, "
          f"with the cache filled ({MAX_CHUNKS:,} chunks at most) {growth['filled_mib']:.1f} MiB")
    stage = stage_timing(loaded["WikiText-2 train"], a.repeats)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"corpora": rows, "memory": growth, "stage": stage}, f, indent=2, allow_nan=False)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
