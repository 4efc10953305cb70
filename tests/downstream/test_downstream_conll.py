"""Labelled token files and the pre-tokenized Beam path (no re-tokenization)."""

import gzip
import re

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to
from elmo_pipeline.transforms.pretokenized import (
    PretokenizedSentences,
    ReadTokenizedFiles,
    TokenizedText,
    pretokenized_sentences,
)

from elmo_pipeline.downstream.conll import ConllError, detect_format, read_conll2003, read_conllu, read_labelled
from support import damaged_gzip, data_path

# Two sentences in the style of UD English EWT (written for this test).
CONLLU = """\
# sent_id = s1
# text = I don't know.
1	I	I	PRON	PRP	_	3	nsubj	_	_
2-3	don't	_	_	_	_	_	_	_	_
2	do	do	AUX	VBP	_	4	aux	_	_
3	n't	not	PART	RB	_	4	advmod	_	_
4	know	know	VERB	VB	_	0	root	_	_
5	.	.	PUNCT	.	_	4	punct	_	_

# sent_id = s2
1	Hi	hi	INTJ	UH	_	0	root	_	_
1.1	gone	_	_	_	_	_	_	_	_
2	!	!	PUNCT	.	_	1	punct	_	_
"""

CONLL2003 = """\
-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC

Peter NNP B-NP B-PER
"""


def test_conllu_words_labels_and_ids(tmp_path):
    path = tmp_path / "x.conllu"
    path.write_text(CONLLU, encoding="utf-8")
    s1, s2 = read_conllu(str(path))
    assert s1.tokens == ("I", "do", "n't", "know", ".") and s1.labels == ("PRON", "AUX", "PART", "VERB", "PUNCT")
    assert s1.sent_id == "s1" and s2.tokens == ("Hi", "!") and s2.labels == ("INTJ", "PUNCT")
    assert next(read_conllu(str(path), "xpos")).labels[1] == "VBP"
    with pytest.raises(ConllError):
        next(read_conllu(str(path), "nope"))


@pytest.mark.parametrize("edit, line, found, wanted", [
    (lambda t: t.replace("5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_\n\n", "5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_\n"),
     10, "1", 6),  # no blank line between the sentences: they ran together
    (lambda t: t.replace("4\tknow", "5\tknow"), 7, "5", 4),  # a number skipped, or a word lost
    (lambda t: t.replace("2\t!", "1\t!"), 13, "1", 2),  # a word numbered twice
])
def test_conllu_words_not_numbered_in_order_are_refused(tmp_path, edit, line, found, wanted):
    path = tmp_path / "x.conllu"
    path.write_text(edit(CONLLU), encoding="utf-8")
    with pytest.raises(ConllError, match=re.escape(f"{path}:{line}: word ID {found} where {wanted} was expected")):
        list(read_conllu(str(path)))


def test_conll2003_and_format_detection(tmp_path):
    path = tmp_path / "eng.train"
    path.write_text(CONLL2003)
    a, b = read_conll2003(str(path))
    assert a.tokens == ("EU", "rejects", "German") and a.labels == ("B-ORG", "O", "B-MISC")
    assert b.labels == ("B-PER",)
    assert [s.labels for s in read_labelled(str(path), label=1)] == [("NNP", "VBZ", "JJ"), ("NNP",)]
    gz = tmp_path / "renamed.txt.gz"
    gz.write_bytes(gzip.compress(CONLLU.encode()))
    assert detect_format(str(path)) == "conll2003" and detect_format(str(gz)) == "conllu"
    assert next(read_labelled(str(gz))).labels[0] == "PRON"


def test_conll2003_lines_of_other_column_counts_and_the_token_as_label_are_refused(tmp_path):
    # a line without its NER tag gave its chunk tag (B-VP) as the label, exit 0
    path = tmp_path / "ragged.txt"
    path.write_text(CONLL2003.replace("rejects VBZ B-VP O", "rejects VBZ B-VP"))
    with pytest.raises(ConllError, match=re.escape(f"{path}:4: 3 columns, but line 3 has 4; every token line needs "
                                                   "the same columns")):
        list(read_conll2003(str(path)))
    path.write_text(CONLL2003)
    for label in ("0", "-4"):
        with pytest.raises(ConllError, match=re.escape(f"{path}:3: column {label} is the token itself, not a label; "
                                                       "give a label column (1 to 3, or -1 for the last)")):
            list(read_labelled(str(path), label=label))
    with pytest.raises(ConllError, match=re.escape(f"{path}:3: no column 4 in 4 columns")):
        list(read_conll2003(str(path), 4))
    assert [s.labels for s in read_conll2003(str(path), -4 + 1)] == [("NNP", "VBZ", "JJ"), ("NNP",)]


def test_ud_ewt_counts_match_the_data_readme():
    ewt = data_path("ud_english_ewt")
    dev = list(read_labelled(str(ewt / "en_ewt-ud-dev.conllu")))
    assert len(dev) == 2001 and sum(len(s.tokens) for s in dev) == 25147


def test_pretokenized_offsets_and_windows():
    item = TokenizedText("d", 4, ("New", "York", "n't", "!"))
    (s,) = pretokenized_sentences(item)
    text = " ".join(item.tokens)
    assert [text[a:b] for a, b in zip(s.char_starts, s.char_ends)] == list(item.tokens)
    assert s.key == ("d", 4, 0)
    w0, w1 = pretokenized_sentences(item, max_sentence_tokens=3)
    assert w0.tokens == ("New", "York", "n't") and w1.tokens == ("!",) and w1.window_index == 1
    np.testing.assert_array_equal(w1.char_starts, [text.index("!")])
    assert pretokenized_sentences(TokenizedText("d", 0, ())) == []
    with pytest.raises(ValueError):
        pretokenized_sentences(TokenizedText("d", 0, ("a", "")))
    for size in (0, -1):  # 0 cut nothing, as if no limit were given
        with pytest.raises(ValueError, match=f"max_sentence_tokens must be >= 1, got {size}"):
            pretokenized_sentences(item, size)


def test_beam_reads_the_files_own_tokens(tmp_path):
    path = tmp_path / "x.conllu"
    path.write_text(CONLLU, encoding="utf-8")
    with test_pipeline.TestPipeline(runner="FnApiRunner") as p:
        got = (p | ReadTokenizedFiles({"dev": str(path)}) | PretokenizedSentences()
               | beam.Map(lambda s: (s.doc_id, s.sentence_index, s.window_index, s.tokens)))
        assert_that(got, equal_to([("dev", 0, 0, ("I", "do", "n't", "know", ".")), ("dev", 1, 0, ("Hi", "!"))]))


def test_a_labelled_file_that_cannot_be_decompressed_is_named(tmp_path, capsys):
    # probe --train given a damaged .gz ended in zlib.error's traceback, naming no file
    from elmo_pipeline.cli.main import main

    sentence = b"1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_\n2\tcat\tcat\tNOUN\t_\t_\t0\troot\t_\t_\n\n"
    train, dev = tmp_path / "a-train.conllu.gz", tmp_path / "a-dev.conllu"
    train.write_bytes(damaged_gzip(sentence * 80))
    dev.write_bytes(sentence)
    said = f"cannot read {train}: zlib.error: Error -3 while decompressing data: "
    with pytest.raises(OSError, match="^" + re.escape(said)):  # read_text_lines' own, as embed-file's
        list(read_labelled(str(train)))
    assert main(["probe", "--train", str(train), "--dev", str(dev), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elmo-pipeline probe: error: {said}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
