import datetime
import importlib.util
import os
import sys

import numpy as np
import pytest
import spacy
import spacy.lang
from spacy.language import Language

from elmo_pipeline.corpus.records import Document, ErrorRecord, Sentence
from elmo_pipeline.corpus.tokenization import build_nlp, sentences_from_docs, tokenize_documents
from support import data_path, run_threads, thread_switches_every


@pytest.fixture(scope="module")
def en():
    return build_nlp("en")


def doc(text: str, doc_id: str = "d", timestamp: str | None = None) -> Document:
    return Document(doc_id, text, "src.txt", 1, timestamp)


def assert_offsets_point_at_tokens(text: str, sentences: list[Sentence]) -> None:
    for s in sentences:
        assert s.char_starts.dtype == np.int64 and s.char_ends.dtype == np.int64
        assert len(s.tokens) == len(s.char_starts) == len(s.char_ends) > 0
        assert [text[a:b] for a, b in zip(s.char_starts, s.char_ends)] == list(s.tokens)


def test_blank_pipeline_gets_a_sentencizer(en):
    assert en.pipe_names == ["sentencizer"]
    assert en.lang == "en"


def test_tokens_offsets_and_dropped_whitespace(en):
    text = "  Hello,  world!\n\nIt's\u3000me.\t "
    (sentences,) = tokenize_documents(en, [doc(text, timestamp="2024-01-01")])
    assert [(s.sentence_index, s.window_index, s.tokens) for s in sentences] == [
        (0, 0, ("Hello", ",", "world", "!")),
        (1, 0, ("It", "'s", "me", ".")),
    ]
    assert sentences[0].char_starts.tolist() == [2, 7, 10, 15]
    assert sentences[1].char_ends.tolist() == [20, 22, 25, 26]
    assert all(s.doc_id == "d" and s.timestamp == "2024-01-01" for s in sentences)
    assert_offsets_point_at_tokens(text, sentences)


def test_long_sentences_are_cut_into_windows_losing_nothing(en):
    docs = [
        doc("one two three four five six seven eight nine ten eleven twelve", "long"),
        doc("Short one. " + "x " * 5 + ". And a last sentence here that is long enough!", "mixed"),
    ]
    whole = list(sentences_from_docs(en, docs, max_sentence_tokens=256))
    cut = list(sentences_from_docs(en, docs, max_sentence_tokens=5))
    long_windows = [s for s in cut if s.doc_id == "long"]
    shape = [(s.sentence_index, s.window_index, len(s.tokens)) for s in long_windows]
    assert shape == [(0, 0, 5), (0, 1, 5), (0, 2, 2)]
    assert all(len(s.tokens) <= 5 for s in cut)
    for d in docs:  # same tokens and offsets, in order, whether cut or not
        for field in ("tokens", "char_starts", "char_ends"):
            joined = [x for s in cut if s.doc_id == d.doc_id for x in getattr(s, field)]
            assert joined == [x for s in whole if s.doc_id == d.doc_id for x in getattr(s, field)]
        assert_offsets_point_at_tokens(d.text, [s for s in cut if s.doc_id == d.doc_id])
    assert [(s.sentence_index, s.window_index, s.tokens) for s in cut if s.doc_id == "mixed"] == [
        (0, 0, ("Short", "one", ".")),
        (1, 0, ("x", "x", "x", "x", "x")),
        (1, 1, (".",)),
        (2, 0, ("And", "a", "last", "sentence", "here")),
        (2, 1, ("that", "is", "long", "enough", "!")),
    ]
    assert sum(len(s.tokens) for s in cut) == sum(len(s.tokens) for s in whole) == 12 + 19
    assert len(whole) == 4 and len(cut) == 8


def test_documents_without_tokens_give_no_sentences(en):
    results = tokenize_documents(en, [doc(" \n\t ", "blank"), doc("Hi.", "hi"), doc("", "empty")])
    assert results[0] == [] and results[2] == []
    assert [s.tokens for s in results[1]] == [("Hi", ".")]
    assert [s.doc_id for s in sentences_from_docs(en, [doc(" ", "blank"), doc("Hi.", "hi")])] == ["hi"]


def test_batching_does_not_change_the_result(en):
    docs = [doc(f"Document {i}. It has {i} words.", f"d{i}") for i in range(7)]

    def key(s: Sentence) -> tuple:
        return (s.key, s.tokens, s.char_starts.tolist())

    assert [key(s) for s in sentences_from_docs(en, docs, batch_size=3)] == [
        key(s) for s in sentences_from_docs(en, docs, batch_size=256)
    ]


def test_too_long_document_is_tokenized_in_pieces_not_rejected():
    # more in tests/test_hardening_inputs.py
    nlp = build_nlp("en")
    nlp.max_length = 10
    results = tokenize_documents(nlp, [doc("short", "a"), doc("much too long text", "b")])
    assert [s.tokens for s in results[0]] == [("short",)]
    (sentence,) = list(results[1])  # lazily, in pieces of at most 10 characters cut at spaces
    assert sentence.tokens == ("much", "too", "long", "text") and sentence.char_starts.tolist() == [0, 5, 9, 14]


@Language.component("fail_on_boom")
def _fail_on_boom(parsed):
    if "boom" in parsed.text:
        raise RuntimeError("boom seen")
    return parsed


def test_a_failing_document_does_not_fail_its_batch():
    nlp = build_nlp("en")
    nlp.add_pipe("fail_on_boom")
    results = tokenize_documents(nlp, [doc("fine", "a"), doc("boom here", "b"), doc("also fine", "c")])
    assert [s.tokens for s in results[0]] == [("fine",)]
    assert results[1] == ErrorRecord("src.txt", 1, "spaCy failed: RuntimeError: boom seen", "tokenize", "b")
    assert [s.tokens for s in results[2]] == [("also", "fine")]


def test_loaded_pipeline_keeps_its_own_sentence_boundaries(tmp_path):
    saved = spacy.blank("en")
    saved.add_pipe("sentencizer", config={"punct_chars": ["|"]})
    saved.to_disk(tmp_path / "pipe")
    nlp = build_nlp(model=str(tmp_path / "pipe"))
    assert nlp.pipe_names == ["sentencizer"]  # no second sentencizer
    (sentences,) = tokenize_documents(nlp, [doc("A. B | C.")])
    assert [s.tokens for s in sentences] == [("A.", "B", "|"), ("C.",)]  # "|" ends sentences, "." does not

    spacy.blank("en").to_disk(tmp_path / "bare")
    assert build_nlp(model=str(tmp_path / "bare")).pipe_names == ["sentencizer"]


# --- Chinese -----------------------------------------------------------------------------------


def ud_sentences(limit: int) -> list[tuple[str, list[str]]]:
    """(text, gold words) of the first `limit` sentences of the Chinese GSD dev sample."""
    path = data_path("ud_chinese_gsd", "zh_gsd-ud-dev.conllu")
    result, text, words = [], None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# text = "):
            text = line[len("# text = "):]
        elif line and not line.startswith("#"):
            word_id, form = line.split("\t")[:2]
            if word_id.isdigit():
                words.append(form)
        elif not line and words:
            result.append((text, words))
            if len(result) == limit:
                break
            words = []
    return result


def word_f1(nlp: Language, sample: list[tuple[str, list[str]]]) -> tuple[float, float]:
    """(F1 of predicted against gold word spans, share of predicted words longer than one character)."""
    results = tokenize_documents(nlp, [doc(text, f"s{i}") for i, (text, _) in enumerate(sample)])
    hits = n_pred = n_gold = multi = 0
    for (text, gold), sentences in zip(sample, results):
        assert_offsets_point_at_tokens(text, sentences)
        predicted = {(a, b) for s in sentences for a, b in zip(s.char_starts.tolist(), s.char_ends.tolist())}
        gold_spans, pos = set(), 0
        for word in gold:
            pos = text.index(word, pos)
            gold_spans.add((pos, pos + len(word)))
            pos += len(word)
        hits += len(predicted & gold_spans)
        n_pred, n_gold = n_pred + len(predicted), n_gold + len(gold_spans)
        multi += sum(b - a > 1 for a, b in predicted)
    return 2 * hits / (n_pred + n_gold), multi / n_pred


@pytest.mark.skipif(importlib.util.find_spec("jieba") is None, reason="jieba is not installed")
def test_chinese_words_with_jieba():
    sample = ud_sentences(100)
    nlp = build_nlp("zh")
    assert nlp.tokenizer.segmenter == "jieba"
    f1, multi_share = word_f1(nlp, sample)
    assert f1 > 0.65 and multi_share > 0.4  # measured: 0.72 and 0.54
    sentences = list(sentences_from_docs(nlp, [doc("包袱很重。我爱北京天安门！")]))
    assert [s.tokens for s in sentences] == [
        ("包袱", "很", "重", "。"), ("我", "爱", "北京", "天安门", "！"),
    ]


def test_chinese_falls_back_to_characters_without_jieba(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "jieba", None)  # what Python does for a package that cannot import
    nlp = build_nlp("zh")
    assert nlp.tokenizer.segmenter == "char"
    assert "single characters" in caplog.text
    sample = ud_sentences(100)
    f1, multi_share = word_f1(nlp, sample)
    assert multi_share == 0.0 and f1 < 0.6


def test_documents_a_caller_built_badly_are_error_records_or_named(en):
    """From a library user's pipeline: a text that is not a str (bytes went to spaCy as a
    serialised Doc), a doc_id of None (rows keyed "None:0:0:0"), or an element that is no Document."""
    from elmo_pipeline.embedding.batch import sentence_weight
    from elmo_pipeline.transforms.tokenize import document_weight

    good = Document("d", "A sentence.", "src", 1)
    docs = [good, good._replace(doc_id="b", text=b"bytes here"), good._replace(doc_id="n", text=None),
            good._replace(doc_id=None)]
    results = tokenize_documents(en, docs)
    assert [t for s in results[0] for t in s.tokens] == ["A", "sentence", "."]
    assert results[1:] == [ErrorRecord("src", 1, "the text is a bytes, not a str", "tokenize", "b"),
                           ErrorRecord("src", 1, "the text is a NoneType, not a str", "tokenize", "n"),
                           ErrorRecord("src", 1, "the doc_id is a NoneType, not a str", "tokenize", None)]
    assert [document_weight(d) for d in docs] == [1, 1, 1, 1]
    for stray in ("just text", {"text": "x"}, None):
        with pytest.raises(TypeError, match="documents to tokenize are Documents, got a"):
            tokenize_documents(en, [good, stray])
        with pytest.raises(TypeError, match="TokenizeWithSpacy takes Documents, got a"):
            document_weight(stray)
        with pytest.raises(TypeError, match="sentences to embed are Sentences, got a"):
            sentence_weight(stray)


def test_a_doc_id_or_timestamp_the_output_cannot_hold_is_an_error_record(en):
    """A library user's Documents skip the readers' checks: a doc_id with a lone surrogate failed
    the whole job in the Parquet writer (and in the errors file), one with a NUL was written as a
    key, and a timestamp that is not ISO 8601 failed the writer, after the model ran."""
    good = Document("d", "A sentence.", "src", 7)
    docs = [good._replace(doc_id="bad\udc00id"), good._replace(doc_id="nul\x00id"),
            good._replace(timestamp="yesterday"), good._replace(timestamp=12345),
            good._replace(timestamp="2024-02-30T00:00:00Z"), good._replace(timestamp="2024-01-01T00:00:00Z"),
            good._replace(timestamp=datetime.date(2024, 5, 1))]
    results = tokenize_documents(en, docs)
    assert results[6] == ErrorRecord("src", 7, "the timestamp is a date, not an ISO 8601 str", "tokenize", "d")
    assert results[:5] == [
        ErrorRecord("src", 7, "the doc_id 'bad\\udc00id' holds a lone surrogate, which UTF-8 cannot encode",
                    "tokenize", None),
        ErrorRecord("src", 7, "the doc_id 'nul\\x00id' contains a NUL character, which key stores refuse",
                    "tokenize", None),
        ErrorRecord("src", 7, "the timestamp 'yesterday' is not ISO 8601", "tokenize", "d"),
        ErrorRecord("src", 7, "the timestamp is a int, not an ISO 8601 str", "tokenize", "d"),
        ErrorRecord("src", 7, "the timestamp '2024-02-30T00:00:00Z' is not ISO 8601", "tokenize", "d")]
    assert [(s.tokens, s.timestamp) for s in results[5]] == [(("A", "sentence", "."), "2024-01-01T00:00:00Z")]


def test_a_lang_that_is_not_the_spacy_models_is_refused(tmp_path):
    """--spacy-model sets the language: another --lang was ignored, and the metadata recorded it."""
    from elmo_pipeline.corpus.tokenization import check_nlp

    spacy.blank("de").to_disk(tmp_path / "de_pipeline")
    assert check_nlp("en", str(tmp_path / "de_pipeline")).lang == "de"  # the default: not given
    assert check_nlp("de", str(tmp_path / "de_pipeline")).lang == "de"
    with pytest.raises(ValueError, match=r"--lang zh is not the language of --spacy-model .*de_pipeline \(de\)"):
        check_nlp("zh", str(tmp_path / "de_pipeline"))


def test_jieba_loads_its_dictionary_without_a_line_on_stderr():
    """Its own DEBUG handler wrote "Building prefix dict ... built successfully." per process."""
    import subprocess

    code = ("from elmo_pipeline.corpus.tokenization import build_nlp\n"
            "print([t.text for t in build_nlp('zh')('我们在银行工作。')])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['我们', '在', '银行', '工作', '。']"
    assert "prefix dict" not in done.stderr.lower(), done.stderr


def test_the_transform_refuses_a_language_spacy_lacks_when_it_is_built():
    """It failed on every worker once the job ran ([E048])."""
    from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

    with pytest.raises(ValueError, match=r"lang 'klingon': spaCy cannot load it .*E048"):
        TokenizeWithSpacy(lang="klingon")
    assert TokenizeWithSpacy(lang="zh") is not None


@pytest.mark.parametrize("lang", ["punctuation", "en.stop_words"])
def test_a_lang_naming_another_module_of_spacy_lang_is_refused_in_one_line(tmp_path, lang, capsys):
    """spaCy imports spacy.lang.<lang> and then failed on it with an AttributeError: a traceback
    from `extract --lang punctuation`, and from every worker with the transform."""
    from elmo_pipeline.cli.main import main
    from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

    (tmp_path / "a.txt").write_text("One document.\n")
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
                 "--tokenizer", "spacy", "--lang", lang]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith(f"elmo-pipeline prepare: error: --lang {lang}: spaCy cannot load it: {lang!r} is a "
                                  "module of spacy.lang, not a language (spaCy's languages: af, ")
    with pytest.raises(ValueError, match=rf"^lang '{lang}': spaCy cannot load it \('{lang}' is a module of spacy"):
        TokenizeWithSpacy(lang=lang)


@pytest.mark.parametrize("lang, package, named", [("ja", "sudachipy", "SudachiPy"), ("ko", "natto", "natto-py"),
                                                  ("th", "pythainlp", "PyThaiNLP"), ("vi", "pyvi", "Pyvi")])
def test_the_transform_refuses_a_language_whose_tokenizer_lacks_its_package_when_it_is_built(lang, package, named):
    """TokenizeWithSpacy(lang="ja") was built without SudachiPy, and the job then failed in every
    worker's setup; the message names the package to install."""
    from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ValueError, match=rf"^lang '{lang}': spaCy cannot load it \(.*{named}"):
        TokenizeWithSpacy(lang=lang)


def test_the_transform_refuses_a_spacy_pipeline_it_cannot_load_when_it_is_built(tmp_path):
    """TokenizeWithSpacy(model=...) naming no installed pipeline was built without a word, and the
    job then failed in every worker's setup ("[E050] Can't find model ... [while running
    'TokenizeWithSpacy/Tokenize/...']"); a pipeline that loads is taken, and tokenizes in a job."""
    import apache_beam as beam
    from apache_beam.testing.util import assert_that, equal_to

    from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

    for missing in ("en_core_web_not_installed", str(tmp_path / "no_pipeline")):
        with pytest.raises(ValueError, match=rf"^model '{missing}': spaCy cannot load it \(\[E050\]"):
            TokenizeWithSpacy(model=missing)
    spacy.blank("de").to_disk(tmp_path / "de_pipeline")
    # a lang beside it that is not its language was ignored without a word
    with pytest.raises(ValueError, match=r"^lang 'fr' is not the language of model '.*de_pipeline' \('de'\)"):
        TokenizeWithSpacy(lang="fr", model=str(tmp_path / "de_pipeline"))
    TokenizeWithSpacy(lang="de", model=str(tmp_path / "de_pipeline"))
    with beam.Pipeline("DirectRunner") as p:
        out = (p | beam.Create([doc("Guten Tag, Welt. Wie geht's?")])
               | TokenizeWithSpacy(model=str(tmp_path / "de_pipeline")))
        assert_that(out["sentences"] | beam.Map(lambda s: s.tokens),
                    equal_to([("Guten", "Tag", ",", "Welt", "."), ("Wie", "geht's", "?")]))  # German's rules: one token


def test_the_transform_builds_no_second_pipeline_after_the_commands_check(monkeypatch):
    """extract checks its spaCy pipeline where it is launched (check_nlp), then builds
    TokenizeWithSpacy, whose own check built the same pipeline again (0.16 to 0.35 s of every
    job) only to learn that it loads. A pipeline this process has not built is still built."""
    from elmo_pipeline.corpus import tokenization
    from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

    monkeypatch.setattr(tokenization, "_BUILT_LANGUAGES", {})  # what other tests built here is not counted
    built = []
    blank = spacy.blank
    monkeypatch.setattr(spacy, "blank", lambda name, *args, **kwargs: built.append(name) or blank(name, *args, **kwargs))
    tokenization.check_nlp("sv")
    TokenizeWithSpacy(lang="sv")
    assert built == ["sv"]
    TokenizeWithSpacy(lang="da")  # the transform alone, as a library user builds it
    assert built == ["sv", "da"]


def test_bidi_controls_and_zero_width_spaces_part_words_and_stay_out_of_tokens():
    """They are not whitespace to str.isspace, nor so to spaCy: "\u202bمرحبا" and "بالعالم\u202c."
    were tokens (the period kept, the sentence's end missed), "ភាសា\u200bខ្មែរ" one word, so an
    invisible mark made another word, vocabulary entry and vector. A zero-width non-joiner stays
    inside its Persian word. A byte-order mark inside a text (a JSON field written from a file read
    with its BOM) was glued to the word after it: "\ufeffHello"."""
    text = ("\u202bمرحبا بالعالم\u202c. هذه جملة؟ \u200fنعم\u200f!\n\u2067שלום\u2069. "
            "ភាសា\u200bខ្មែរ می\u200cخواهم\n\ufeffHello\ufeff world.")
    (sentences,) = tokenize_documents(build_nlp("xx"), [doc(text)])
    assert [s.tokens for s in sentences] == [("مرحبا", "بالعالم", "."), ("هذه", "جملة", "؟"), ("نعم", "!"),
                                             ("שלום", "."), ("ភាសា", "ខ្មែរ", "می\u200cخواهم", "Hello", "world", ".")]
    assert_offsets_point_at_tokens(text, sentences)
    covered = {i for s in sentences for a, b in zip(s.char_starts, s.char_ends) for i in range(a, b)}
    assert {text[i] for i in set(range(len(text))) - covered} == set(" \n\u202b\u202c\u200f\u2067\u2069\u200b\ufeff")


@pytest.mark.parametrize("lang, says", [
    ("EN", r"--lang EN: spaCy cannot load it: \[E048\].* \(spaCy's code for it is 'en'\)$"),
    ("en-US", r"--lang en-US: spaCy cannot load it: \[E048\].* \(spaCy's code for it is 'en'\)$"),
    ("pt_BR", r"--lang pt_BR: spaCy cannot load it: \[E048\].* \(spaCy's code for it is 'pt'\)$"),
    ("", r"^--lang '' is empty: give a spaCy language code \(en, zh, de, \.\.\.\)$"),
    ("klingon", r"--lang klingon: spaCy cannot load it: \[E048\].*'spacy\.lang\.klingon' \(spaCy's languages: af, .*\)$")])
def test_a_language_tag_spacy_does_not_take_is_refused_with_its_code(lang, says):
    """A capitalised code or a tag with a region was refused without saying what spaCy takes, and
    an empty one as the language "" of module "spacy.lang." ."""
    from elmo_pipeline.corpus.tokenization import check_nlp

    with pytest.raises(ValueError, match=says):
        check_nlp(lang)


def test_a_text_holding_surrogate_escaped_bytes_is_an_error_record_saying_so(en):
    """A caller's text decoded with errors="surrogateescape" (Latin-1 bytes read as UTF-8) made
    spaCy fail its whole batch, and the record said "UnicodeEncodeError: 'utf-8' codec can't
    encode character '\\udce9'"; the readers say what is wrong, and so does the tokenizer now."""
    bad = b"caf\xe9 au lait.".decode("utf-8", "surrogateescape")
    results = tokenize_documents(en, [doc("Fine here.", "a"), doc(bad, "b"), doc("Also fine.", "c")])
    assert [s.tokens for s in results[0]] == [("Fine", "here", ".")]
    assert results[1] == ErrorRecord("src.txt", 1, "the text holds a lone surrogate, which UTF-8 cannot encode (bytes "
                                     "that were not UTF-8, decoded with errors='surrogateescape'?)", "tokenize", "b")
    assert [s.tokens for s in results[2]] == [("Also", "fine", ".")]


@pytest.mark.skipif(importlib.util.find_spec("jieba") is None, reason="jieba is not installed")
def test_jieba_keeps_words_of_other_scripts_whole():
    """jieba keeps runs of ideographs and ASCII together and cut at every other letter: "Müller" was
    "M", "ü", "ller", "café" "caf", "é", "Việt" "Vi", "ệ", "t"; the 500 sentences of the UD Chinese
    GSD dev sample keep their tokens."""
    nlp = build_nlp("zh", segmenter="jieba")
    text = "我喜欢Müller和café，还有Việt Nam。iPhone手机2024年São Paulo的Ωmega"
    (sentences,) = tokenize_documents(nlp, [doc(text)])
    assert [t for s in sentences for t in s.tokens] == [
        "我", "喜欢", "Müller", "和", "café", "，", "还有", "Việt", "Nam", "。",
        "iPhone", "手机", "2024", "年", "São", "Paulo", "的", "Ωmega"]
    assert_offsets_point_at_tokens(text, sentences)


@pytest.mark.parametrize("lang", ["xx", "en"])
def test_the_sentence_ends_of_other_scripts_end_sentences(lang):
    """spaCy's sentencizer knows Burmese ။ and Ethiopic ።, but most languages' suffix rules (xx's
    among them) left them on the word before: "မြန်မာဘာသာ။" was one token, and a Burmese document
    one sentence. Khmer's ។ the sentencizer did not know. WikiText's and EWT's tokens and
    sentences are spaCy's own still (measured)."""
    text = "မြန်မာဘာသာ။ ဒုတိယဝါကျ။ ሰላም። ደህና። ភាសាខ្មែរ។ នេះ។ U.S. ok."
    (sentences,) = tokenize_documents(build_nlp(lang), [doc(text)])
    assert [s.tokens for s in sentences] == [("မြန်မာဘာသာ", "။"), ("ဒုတိယဝါကျ", "။"), ("ሰላም", "።"), ("ደህና", "።"),
                                             ("ភាសាខ្មែរ", "។"), ("នេះ", "។"), ("U.S.", "ok", ".")]
    assert_offsets_point_at_tokens(text, sentences)


def _spacy_store_sizes(nlp: Language) -> tuple[int, int]:
    """The strings and the lexemes `nlp`'s vocabulary holds (its len() counts every lexeme ever made)."""
    return len(nlp.vocab.strings), sum(1 for _ in nlp.vocab)


def test_spacys_strings_do_not_grow_with_the_new_words_of_a_corpus(monkeypatch):
    """spaCy kept every new string and a lexeme for it: over a corpus of billions of tokens (numbers,
    names, typos) that grows without end, about 400 bytes a new word. Each batch and each piece of a
    long document is parsed in a memory zone, so what is kept is the chunk cache's (bounded) alone."""
    from elmo_pipeline.corpus import chunk_cache, tokenization

    nlp = build_nlp("en")
    chunk_cache._CACHES[nlp] = chunk_cache.ChunkCache(nlp.tokenizer, max_chunks=50)  # full after the first batch
    monkeypatch.setattr(tokenization, "PIECE_CHARS", 4000)

    def words(batch: int, doc_index: int, n: int) -> list[str]:
        return [f"w{batch}x{doc_index}x{k}" for k in range(n)]

    def batch(k: int) -> list[Document]:
        return [doc(" ".join(words(k, i, 20)) + ".", f"b{k}d{i}") for i in range(64)]

    tokenize_documents(nlp, batch(0))
    after_first = _spacy_store_sizes(nlp)
    for k in range(1, 6):  # 6,400 new words
        results = tokenize_documents(nlp, batch(k))
        assert [list(s.tokens) for r in results for s in r] == [words(k, i, 20) + ["."] for i in range(64)]
    assert _spacy_store_sizes(nlp) == after_first

    text = " ".join(words(9, 0, 3000)) + "."  # 35 KB: 9 pieces
    (sentences,) = tokenize_documents(nlp, [doc(text, "long")], max_sentence_tokens=1000)
    sentences = list(sentences)
    assert [t for s in sentences for t in s.tokens] == words(9, 0, 3000) + ["."]
    assert [len(s.tokens) for s in sentences] == [1000, 1000, 1000, 1]
    assert_offsets_point_at_tokens(text, sentences)
    assert _spacy_store_sizes(nlp) == after_first


def test_a_callers_own_memory_zone_is_left_open(en):
    """spaCy's zones do not nest: one opened inside a caller's and closed would let go of the
    caller's strings while its Docs still use them. Inside the caller's zone nothing is opened."""
    with en.memory_zone():
        kept = en("Zyxwvut qrstuv.")
        (sentences,) = tokenize_documents(en, [doc("Abcdefgh ijklmno.")])
        assert en.vocab.in_memory_zone
        assert [t.text for t in kept] == ["Zyxwvut", "qrstuv", "."]
        assert "Abcdefgh" in en.vocab.strings
    assert [s.tokens for s in sentences] == [("Abcdefgh", "ijklmno", ".")]
    assert "Abcdefgh" not in en.vocab.strings and "Zyxwvut" not in en.vocab.strings


def test_threads_sharing_one_pipeline_get_their_own_tokens():
    """spaCy's vocabulary is not safe under threads adding new strings at once: 4 threads tokenizing
    new words with one pipeline got KeyError E018 ("Can't retrieve string for hash") and "the
    tokenizer changed the text" records, and a memory zone opened by one thread let go of the
    strings under another's Docs. One thread at a time tokenizes with a pipeline."""
    nlp = build_nlp("en")
    failures: list[object] = []

    def words(thread: int, batch: int, i: int) -> list[str]:
        return [f"t{thread}b{batch}d{i}w{k}" for k in range(12)]

    def work(thread: int) -> None:
        try:
            for batch in range(15):
                docs = [doc(" ".join(words(thread, batch, i)) + ".", f"{thread}:{batch}:{i}") for i in range(16)]
                for i, result in enumerate(tokenize_documents(nlp, docs)):
                    expected = words(thread, batch, i) + ["."]
                    if not isinstance(result, list) or [t for s in result for t in s.tokens] != expected:
                        failures.append(result)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            failures.append(e)

    with thread_switches_every(1e-6):  # as under load
        run_threads(work, 4)
    assert failures == []


def test_a_language_or_pipeline_spacy_lacks_is_refused_naming_what_is_here_and_how_to_add_one(tmp_path, capsys):
    """`--lang klingon` and `--spacy-model zh_core_web_sm` (not installed) gave spaCy's E048/E050
    alone, naming neither the languages spaCy has nor the pipelines installed, nor how to add one."""
    from elmo_pipeline.cli.main import main
    from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

    lang_folder = os.path.dirname(spacy.lang.__file__)
    languages = sorted(name for name in os.listdir(lang_folder)
                       if os.path.isfile(os.path.join(lang_folder, name, "__init__.py")))
    assert {"en", "zh", "xx", "hi", "ar"} <= set(languages)
    named = f"(spaCy's languages: {', '.join(languages)}; xx, its multi-language rules, takes any other)"
    (tmp_path / "a.txt").write_text("One document.\n")
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
                 "--tokenizer", "spacy", "--lang", "klingon"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elmo-pipeline prepare: error: --lang klingon: spaCy cannot load it: [E048]")
    assert err.endswith(named)
    with pytest.raises(ValueError) as refused:
        TokenizeWithSpacy(lang="klingon")
    assert str(refused.value).endswith(named)
    # a tag of a language spaCy has keeps its one hint, the code to give
    with pytest.raises(ValueError) as refused:
        TokenizeWithSpacy(lang="pt_BR")
    assert str(refused.value).endswith("(spaCy's code for it is 'pt')")

    installed = ", ".join(sorted(spacy.util.get_installed_models())) or "none"
    missing = "zh_core_web_not_installed"
    pipelines = (f"(pipelines installed here: {installed}; install one with `python -m spacy download NAME` where "
                 "the job is launched and on the workers, or give a pipeline's folder)")
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
                 "--tokenizer", "spacy", "--spacy-model", missing]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"elmo-pipeline prepare: error: --spacy-model {missing}: spaCy cannot load it: [E050]")
    assert err.endswith(pipelines)
    with pytest.raises(ValueError) as refused:
        TokenizeWithSpacy(model=missing)
    assert str(refused.value).endswith(pipelines)


def test_a_pipeline_found_whose_tokenizer_lacks_a_package_is_not_told_to_install_a_pipeline(tmp_path, capsys):
    """A --spacy-model that spaCy found but could not build for want of a package (a Japanese
    pipeline's folder without SudachiPy) got spaCy's line naming the package, then 'pipelines
    installed here: none; install one with `python -m spacy download NAME` ..., or give a
    pipeline's folder', for a folder that is one. A name spaCy finds nothing by keeps the list."""
    from elmo_pipeline.cli.main import main
    from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

    if importlib.util.find_spec("sudachipy") is not None:
        pytest.skip("sudachipy is installed here")
    nlp = spacy.blank("en")
    nlp.to_disk(tmp_path / "ja_pipeline")
    config = tmp_path / "ja_pipeline" / "config.cfg"
    config.write_text(config.read_text().replace('lang = "en"', 'lang = "ja"').replace(
        '@tokenizers = "spacy.Tokenizer.v1"', '@tokenizers = "spacy.ja.JapaneseTokenizer"'))
    pipeline = str(tmp_path / "ja_pipeline")
    with pytest.raises(ImportError) as missing:
        spacy.blank("ja")
    sudachi = str(missing.value)  # spaCy's line, naming SudachiPy
    assert "SudachiPy" in sudachi
    (tmp_path / "a.txt").write_text("One document.\n")
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
                 "--tokenizer", "spacy", "--spacy-model", pipeline]) == 2
    assert capsys.readouterr().err.strip() == (
        f"elmo-pipeline prepare: error: --spacy-model {pipeline}: spaCy cannot load it: {sudachi}")
    with pytest.raises(ValueError) as refused:
        TokenizeWithSpacy(model=pipeline)
    assert str(refused.value) == f"model {pipeline!r}: spaCy cannot load it ({sudachi})"
    with pytest.raises(ValueError, match=r"\(\[E050\].*\(pipelines installed here: "):
        TokenizeWithSpacy(model=str(tmp_path / "no_pipeline"))
