"""`pretrain --init` starts from the model it is given: before any step, the model it builds gives
the --init model's vectors bit for bit, for the words its vocabulary gained too (those the --init
model read as its unknown word)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from elmo_pipeline.corpus.records import Document
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.trainer import train
from support import data_path

# a char CNN beside a word embedding, as the default model and ELMoForManyLangs models have
WORDS_AND_CHARS = {"token_encoder": "char_cnn+word", "word_embedding_dim": 6,
                   "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4], [2, 8]], "n_highway": 1},
                   "lstm": {"dim": 16, "projection_dim": 8, "n_layers": 2, "use_skip_connections": True},
                   "softmax": {"kind": "full"}}


def _prepare(text: str, folder: Path, lang: str = "en") -> str:
    prepare_in_process(whitespace_sentences(Document("d", text, "d", 1), 40), str(folder), tokenizer="whitespace",
                       lang=lang, max_sentence_tokens=40, shard_tokens=10**6)
    return str(folder)


def _start_of(init: str, data: str, run: Path) -> BiLM:
    """The model `pretrain --init` starts from (--max-steps 0 publishes it as model/)."""
    train(TrainArgs(data=data, output=str(run), preset=None, init=init, max_steps=0, threads=1))
    return BiLM.from_pretrained(str(run / "model")).eval()


def _assert_same_vectors(tuned: BiLM, source: BiLM, sentences: list[list[str]]) -> None:
    n = len(source.vocab)
    added = tuned.vocab.tokens[n:]
    assert len(added) >= 3  # the vocabulary grew
    unknown = source.vocab.unk_id
    with_new = [s for s in sentences if set(tuned.token_keys(s)) & set(added)]
    assert with_new and all(source.vocab.ids(source.token_keys(s)).tolist().count(unknown) for s in with_new)
    with torch.inference_mode():
        before, after = source.embed(sentences).layers.numpy(), tuned.embed(sentences).layers.numpy()
    assert np.array_equal(after, before), float(np.abs(after - before).max())
    # the new words' rows are the unknown word's, the row the --init model read them by (they were
    # N(0, 1) before: the default model's vectors moved by up to 6.8)
    table = tuned.token_encoder.word_embedding.weight
    assert torch.equal(table[:n], source.token_encoder.word_embedding.weight)
    assert torch.equal(table[n:], source.token_encoder.word_embedding.weight[unknown].expand(len(added), -1))


def test_a_native_init_models_new_words_start_as_its_unknown_word(tmp_path):
    spec = tmp_path / "shape.json"
    spec.write_text(json.dumps(WORDS_AND_CHARS), encoding="utf-8")
    base = tmp_path / "base"
    train(TrainArgs(data=_prepare("the cat sat on the mat .\na dog ran in the park .\n" * 4, tmp_path / "a"),
                    output=str(base), preset=None, model_config=str(spec), max_steps=3, batch_tokens=40, threads=1))
    text = "the quokka sat on the zyzzyva .\na dog ran past the axolotl .\nthe cat sat .\n"
    tuned = _start_of(str(base / "model"), _prepare(text, tmp_path / "b"), tmp_path / "tuned")
    _assert_same_vectors(tuned, BiLM.from_pretrained(str(base / "model")).eval(),
                         [line.split() for line in text.splitlines()])


def test_an_elmoformanylangs_init_models_new_words_start_as_its_unknown_word(tmp_path):
    fixture = data_path("formanylangs", "fixture_small")
    imported = tmp_path / "imported"
    BiLM.from_formanylangs(str(fixture / "model")).save_pretrained(str(imported))
    sentences = json.loads((fixture / "sentences.json").read_text(encoding="utf-8"))[:12]
    sentences += [["zyzzyva", "quokka", "antidisestablishmentarianism", "饕餮", "。"]]
    data = _prepare("".join(" ".join(s) + "\n" for s in sentences), tmp_path / "data", lang="zh")
    _assert_same_vectors(_start_of(str(imported), data, tmp_path / "tuned"),
                         BiLM.from_pretrained(str(imported)).eval(), sentences)
