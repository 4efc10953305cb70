"""`prepare` (Beam): vocabulary and shards, identical to the in-process path; Chinese text."""

import collections
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.corpus.records import Document
from elmo_pipeline.training.prepare import (build_vocabulary, prepare_in_process, whitespace_sentences,
                                            windows)
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.shards import PreparedCorpus, shard_of, shard_table
from elmo_pipeline.training.trainer import train
from support import data_path, lose_the_first_text_record


def _cut(src, dst, n_lines, start=0):
    with open(src, encoding="utf-8") as f:
        lines = [line for i, line in enumerate(f) if start <= i < start + n_lines]
    dst.write_text("".join(lines), encoding="utf-8")
    return lines


def _run_prepare(argv):
    from elmo_pipeline.cli.training import main

    assert main(["prepare", *argv]) == 0


def test_whitespace_sentences_windows_and_offsets():
    text = "a b  c\n\n d e f g h\n"
    sentences = whitespace_sentences(Document("d", text, "src", 1), max_tokens=3)
    assert [s.tokens for s in sentences] == [("a", "b", "c"), ("d", "e", "f"), ("g", "h")]
    assert [(s.sentence_index, s.window_index) for s in sentences] == [(0, 0), (1, 0), (1, 1)]
    for s in sentences:
        assert [text[a:b] for a, b in zip(s.char_starts, s.char_ends)] == list(s.tokens)
    assert windows(5, 2) == [(0, 2), (2, 4), (4, 5)]


def test_rows_that_share_a_key_are_ordered_by_their_tokens_not_their_arrival():
    """Two documents with one id: their rows' order followed the order they came in."""
    vocab = build_vocabulary(collections.Counter({"a": 2, "b": 1}), n_sentences=3)
    rows = [(("x", 0, 0), ("b", "a")), (("x", 0, 0), ("a", "b")), (("w", 1, 0), ("a",))]
    first, second = shard_table(rows, vocab), shard_table(rows[::-1], vocab)
    assert first.equals(second)
    assert first.column("tokens").to_pylist() == [["a"], ["a", "b"], ["b", "a"]]


def test_vocabulary_counts_specials_and_unk_alias():
    counts = {"the": 5, "<unk>": 3, "cat": 2, "dog": 2, "rare": 1}
    v = build_vocabulary(counts, n_sentences=4, min_count=2, unk_alias="<unk>")
    assert v.tokens == ["<S>", "</S>", "<UNK>", "the", "cat", "dog"]
    assert v.counts == [4, 4, 4, 5, 2, 2]  # <UNK> = 3 x <unk> + 1 rare word
    v = build_vocabulary(counts, 4, max_size=4)
    assert v.tokens == ["<S>", "</S>", "<UNK>", "the"] and v.counts[2] == 3 + 2 + 2 + 1


def test_beam_prepare_matches_in_process_and_keeps_wikitext_vocabulary(tmp_path):
    src = data_path("wikitext2", "wiki.valid.tokens")
    sample = tmp_path / "wiki.txt"
    lines = _cut(src, sample, 150)
    out = tmp_path / "beam"
    _run_prepare(["--input", str(sample), "--output", str(out), "--tokenizer", "whitespace", "--unk-token", "<unk>",
                  "--max-sentence-tokens", "64", "--shard-tokens", "2000"])
    corpus = PreparedCorpus(str(out))
    m = corpus.manifest
    words = [t for line in lines for t in line.split()]
    assert m.tokens == len(words) and m.sentences == sum(
        len(windows(len(line.split()), 64)) for line in lines if line.split())
    assert len(m.shards) == corpus.n_shards > 1
    # WikiText's own vocabulary: its word types, <unk> being our <UNK>, plus the boundaries
    types = set(words)
    assert len(corpus.vocab) == len(types - {"<unk>"}) + 3
    assert "<unk>" not in corpus.vocab.index
    assert corpus.vocab.counts[2] == words.count("<unk>")
    # ids agree with the tokens; <unk> is id 2
    for shard in range(corpus.n_shards):
        tokens, ids = corpus.read_shard(shard)
        for t, i in zip(tokens, ids):
            assert list(i) == [2 if w == "<unk>" else corpus.vocab.index[w] for w in t]
    # the same shards, byte for byte, from the in-process path
    doc_sentences = []
    with open(sample, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            doc_sentences += whitespace_sentences(Document(f"{sample}:{number}", line.rstrip("\n"), str(sample),
                                                           number), 64)
    # doc ids follow ReadDocuments' "<url>:<line>"; read them back from a shard to be sure
    first = pq.read_table(out / m.shards[0].file, columns=["doc_id"]).column("doc_id")[0].as_py()
    prefix = first.rsplit(":", 1)[0]
    doc_sentences = [s._replace(doc_id=f"{prefix}:{s.doc_id.rsplit(':', 1)[1]}") for s in doc_sentences]
    local = tmp_path / "local"
    prepare_in_process(doc_sentences, str(local), tokenizer="whitespace", lang="en", max_sentence_tokens=64,
                       unk_alias="<unk>", shard_tokens=2000)
    for info in m.shards:
        assert (out / info.file).read_bytes() == (local / info.file).read_bytes(), info.file
    assert (out / "vocab.json").read_bytes() == (local / "vocab.json").read_bytes()
    # every sentence sits in the shard its key hashes to
    for index, info in enumerate(m.shards):
        table = pq.read_table(out / info.file, columns=["doc_id", "sentence_index", "window_index"]).to_pylist()
        assert all(shard_of((r["doc_id"], r["sentence_index"], r["window_index"]), len(m.shards)) == index
                   for r in table)


def test_prepare_refuses_a_used_output_without_overwrite(tmp_path, capsys):
    sample = tmp_path / "a.txt"
    sample.write_text("x y\n", encoding="utf-8")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text("{}")
    from elmo_pipeline.cli.training import main

    assert main(["prepare", "--input", str(sample), "--output", str(tmp_path / "out"),
                 "--tokenizer", "whitespace"]) == 2
    assert "out is not empty; pass --overwrite" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == ["manifest.json"]


def test_chinese_prepare_and_pretrain(tmp_path):
    """spaCy tokenization of Chinese text (UD Chinese GSD dev, cut at run time), then training."""
    src = data_path("ud_chinese_gsd", "zh_gsd-ud-dev.conllu")
    texts = []
    with open(src, encoding="utf-8") as f:
        for line in f:
            if line.startswith("# text = "):
                texts.append(line[len("# text = "):].strip())
            if len(texts) >= 40:
                break
    sample = tmp_path / "zh.jsonl"
    sample.write_text("".join(json.dumps({"id": f"s{i}", "text": t}, ensure_ascii=False) + "\n"
                              for i, t in enumerate(texts)), encoding="utf-8")
    out = tmp_path / "prepared"
    _run_prepare(["--input", str(sample), "--output", str(out), "--format", "jsonl", "--id-field", "id",
                  "--lang", "zh", "--shard-tokens", "400"])
    corpus = PreparedCorpus(str(out))
    assert corpus.manifest.lang == "zh" and corpus.manifest.tokens > 300
    words = [w for shard in range(corpus.n_shards) for s in corpus.read_shard(shard)[0] for w in s]
    assert all(w.strip() for w in words)
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in w) for w in corpus.vocab.tokens[3:])
    assert sum(map(len, words)) == sum(len("".join(t.split())) for t in texts)  # only spaces are dropped
    run = tmp_path / "run"
    result = train(TrainArgs(data=str(out), output=str(run), preset="tiny", max_steps=4, batch_tokens=400,
                             threads=1, log_every=2, checkpoint_every=2))
    assert result["done"]
    from elmo_pipeline import BiLM

    model = BiLM.from_pretrained(str(run / "model"))
    emb = model.eval().embed([["包袱", "很", "重"]])
    assert emb.layers.shape[:3] == (3, 1, 3) and np.isfinite(emb.layers.detach().numpy()).all()


def test_prepare_plans_its_chinese_segmenter_for_every_worker_and_records_it(tmp_path, monkeypatch):
    """Each worker of `prepare` chose jieba or single characters for itself and the manifest said
    neither (nor spaCy's code for `--lang zho`): a worker without jieba cut its documents into
    characters among the others' words, unseen. The choice is made where the job is launched, as
    `extract` makes it, every worker uses it, and the manifest records it."""
    import jieba

    from elmo_pipeline.pipelines import prepare as prepare_job

    sample = tmp_path / "zh.txt"
    sample.write_text("包袱很重。我爱北京天安门！\n", encoding="utf-8")
    words = ["包袱", "很", "重", "。", "我", "爱", "北京", "天安门", "！"]

    def prepared(name: str, *options: str) -> PreparedCorpus:
        _run_prepare(["--input", str(sample), "--output", str(tmp_path / name), "--tokenizer", "spacy", *options])
        corpus = PreparedCorpus(str(tmp_path / name))
        assert corpus.manifest.lang == "zh"
        return corpus

    corpus = prepared("words", "--lang", "zho")
    assert corpus.manifest.segmentation == {"segmenter": "jieba", "jieba_version": jieba.__version__}
    assert sorted(corpus.vocab.tokens[3:]) == sorted(words)
    assert json.loads((tmp_path / "words" / "manifest.json").read_text())["segmentation"]["segmenter"] == "jieba"

    # launched where jieba cannot be imported: the workers (jieba imports in this process) cut characters too
    monkeypatch.setattr(prepare_job, "planned_segmenter", lambda lang, model: "char")
    corpus = prepared("characters", "--lang", "zh")
    assert corpus.manifest.segmentation == {"segmenter": "char",
                                            "fallback": "jieba could not be imported: single characters"}
    assert sorted(corpus.vocab.tokens[3:]) == sorted(set("".join(words)))


@pytest.mark.parametrize("option, value, says", [
    ("--min-count", "0", "--min-count must be >= 1, got 0"),  # it named three options at once
    ("--shard-tokens", "-5", "--shard-tokens must be >= 1, got -5"),
    ("--max-vocab", "2", "--max-vocab must leave room for <S>, </S> and <UNK> (>= 3), got 2"),
    # the shards gave '<S>' the unknown id, where the char CNN and every lookup of it read the boundary
    ("--unk-token", "<S>", "--unk-token <S>: that token marks a sentence boundary"),
    ("--unk-token", "</S>", "--unk-token </S>: that token marks a sentence boundary"),
])
def test_prepare_names_the_option_out_of_its_range(tmp_path, capsys, option, value, says):
    from elmo_pipeline.cli.training import main

    sample = tmp_path / "a.txt"
    sample.write_text("x y\n", encoding="utf-8")
    assert main(["prepare", "--input", str(sample), "--output", str(tmp_path / "out"), "--tokenizer", "whitespace",
                 option, value]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_vocabulary_counts_every_token_the_shards_give_an_id(tmp_path):
    """A token of the text spelling `<S>` or `</S>` gets that word's id in the shards (as the char
    CNN reads it as the boundary), but was left out of every count, where one spelling `<UNK>` was
    counted: the counts fell short of the tokens by those words. Each id's count is now how often
    the shards give it, plus one per sentence for the boundaries."""
    sample = tmp_path / "a.txt"
    sample.write_text("<S> the cat </S>\nthe <UNK> dog </S>\nrare the\n", encoding="utf-8")
    out = tmp_path / "out"
    _run_prepare(["--input", str(sample), "--output", str(out), "--tokenizer", "whitespace", "--min-count", "2"])
    corpus = PreparedCorpus(str(out))
    ids = np.concatenate([i for shard in range(corpus.n_shards) for i in corpus.read_shard(shard)[1]])
    given = np.bincount(ids, minlength=len(corpus.vocab))
    n = corpus.manifest.sentences
    assert corpus.vocab.tokens == ["<S>", "</S>", "<UNK>", "the"]
    assert corpus.vocab.counts == [n + 1, n + 2, 4, 3] == [4, 5, 4, 3]  # <UNK>: its spelling, cat, dog, rare
    assert list(given + np.array([n, n, 0, 0])) == corpus.vocab.counts
    assert sum(corpus.vocab.counts) == corpus.manifest.tokens + 2 * n == 16


def test_records_or_sentences_lost_after_they_were_counted_fail_prepare(tmp_path, monkeypatch, capsys):
    """prepare's summary counted the lines of errors.jsonl and the manifest's rows, and checked
    neither against what the job counted on its way: a rejected record lost before its sink, or a
    sentence lost between the vocabulary's count and its shard, left a run that exited 0."""
    from elmo_pipeline.cli.training import main
    from elmo_pipeline.pipelines import prepare as prepare_job

    sample = tmp_path / "a.txt"
    sample.write_bytes(b"one two\n\xff bad\nthree\n\xfe worse\n")
    argv = ["--input", str(sample), "--tokenizer", "whitespace"]
    assert main(["prepare", *argv, "--output", str(tmp_path / "whole")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert (whole["errors"], whole["errors_counted"], whole["errors_reconcile"], whole["counts_reconcile"]) == (
        2, 2, True, True)
    assert sum(PreparedCorpus(str(tmp_path / "whole")).vocab.counts) == 3 + 2 * 2

    lose_the_first_text_record(monkeypatch)
    assert main(["prepare", *argv, "--output", str(tmp_path / "errors")]) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert (summary["errors"], summary["errors_counted"], summary["errors_reconcile"]) == (1, 2, False)
    assert summary["counts_reconcile"] is True
    assert "errors.jsonl holds 1 records, but the job counted 2 rejected ones" in captured.err
    monkeypatch.undo()

    kept_table = prepare_job.shard_table
    monkeypatch.setattr(prepare_job, "shard_table", lambda rows, *rest: kept_table(list(rows)[1:], *rest))
    assert main(["prepare", *argv, "--output", str(tmp_path / "rows")]) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert (summary["sentences"], summary["counts_reconcile"], summary["errors_reconcile"]) == (1, False, True)
    assert "the vocabulary's counts are not the shards' tokens plus two a sentence" in captured.err


def test_shard_names_past_99999_shards_are_the_runs_own_and_sort_by_index():
    """shard_name padded to five digits, and SHARD_NAME took five: a run of 100,000 shards or more
    (--shard-tokens small for the corpus) wrote 'shard-00000-of-100000.parquet', which --overwrite
    and a failed job's cleanup did not take for the run's (left beside the next run's), and past
    a million the names sorted 'shard-100000' before 'shard-99999'."""
    from elmo_pipeline.pipelines.prepare import _is_run_output
    from elmo_pipeline.training.shards import SHARD_NAME, shard_name

    assert shard_name(7, 12) == "shard-00007-of-00012.parquet"  # as before
    assert shard_name(7, 100_000) == "shard-000007-of-100000.parquet"
    for count in (1, 12, 99_999, 100_000, 1_234_567):
        names = [shard_name(i, count) for i in sorted({0, 1, 99_999 % count, 100_000 % count, count - 1})]
        assert all(SHARD_NAME.fullmatch(name) and _is_run_output(name) for name in names), names
        assert sorted(names) == names


def test_a_signal_while_shards_are_written_leaves_the_earlier_run_alone(tmp_path):
    """SIGTERM on `prepare --overwrite` as its first shard appeared: the earlier run was put back, but
    the job's threads in this process went on writing shards until the process ended (5 of 83 new
    ones beside the earlier 59, measured), so the folder held two runs; and a partial file a thread
    began after the earlier run was put back stayed."""
    import signal
    import subprocess
    import sys

    text = "".join(f"line {i} holds words {i % 97} and {i % 89} .\n" for i in range(6000))
    (tmp_path / "in.txt").write_text(text)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "elmo_pipeline.pipelines.prepare", "--input", str(tmp_path / "in.txt"),
               "--output", str(out), "--tokenizer", "whitespace", "--overwrite"]
    out.mkdir()
    earlier = {"manifest.json": b"{}", "vocab.json": b"{}", "errors.jsonl": b"", "shard-00000-of-00001.parquet": b"1"}
    for name, data in earlier.items():  # what --overwrite replaces, by its names
        (out / name).write_bytes(data)
    proc = subprocess.Popen([*command, "--shard-tokens", "100", "--direct_running_mode", "multi_threading",
                             "--direct_num_workers", "2"], stderr=subprocess.PIPE, text=True)
    try:
        while not any("-of-00" in p.name and p.name not in earlier for p in out.iterdir()):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
