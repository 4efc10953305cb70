"""Fine-tuning an imported ELMoForManyLangs model (`pretrain --init`): its character dictionary and
word specials go through training, checkpoints and the saved model; the corpus's new words are
added by the keys the model looks them up by."""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from elmo_pipeline.corpus.records import Document
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.training.evaluate import evaluate
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.trainer import train
from support import data_path

NEW_WORDS = "zyzzyva quokka antidisestablishmentarianism 饕餮"


def test_pretrain_init_from_an_imported_model_keeps_its_family(tmp_path):
    fixture = data_path("formanylangs", "fixture_small")
    imported = tmp_path / "imported"
    BiLM.from_formanylangs(str(fixture / "model")).save_pretrained(str(imported))
    sentences = json.loads((fixture / "sentences.json").read_text(encoding="utf-8"))
    text = "".join(" ".join(s) + "\n" for s in sentences) + f"{NEW_WORDS} 。\n" * 3
    prepare_in_process(whitespace_sentences(Document("d", text, "d", 1), 40), str(tmp_path / "data"),
                       tokenizer="whitespace", lang="zh", max_sentence_tokens=40, shard_tokens=10**6)
    train(TrainArgs(data=str(tmp_path / "data"), output=str(tmp_path / "run"), preset=None, init=str(imported),
                    max_steps=2, epochs=5, batch_tokens=200, lr=1e-9, clip_norm=None, dropout=0.0, threads=1,
                    log_every=100, checkpoint_every=100))
    tuned = BiLM.from_pretrained(str(tmp_path / "run" / "model")).eval()
    source = BiLM.from_pretrained(str(imported)).eval()
    assert tuned.chars == source.chars and tuned.config.char_dictionary == source.config.char_dictionary
    assert tuned.vocab.specials == ("<bos>", "<eos>", "<oov>")
    n = len(source.vocab)
    assert tuned.vocab.tokens[:n] == source.vocab.tokens
    added = tuned.vocab.tokens[n:]
    assert {"zyzzyva", "quokka", "饕餮", "antidisestablishme"} <= set(added)  # 18 characters: the model's key
    assert not {"<S>", "</S>", "<UNK>", "antidisestablishmentarianism"} & set(added)
    assert tuned.softmax is not None and tuned.config.vocab_size == len(tuned.vocab)
    # lr ~ 0: the weights are the imported ones, so a sentence whose words all keep their rows (no
    # word of it was added to the vocabulary) gets the family's vectors still
    same = [s for s in sentences if np.array_equal(tuned.vocab.ids(tuned.token_keys(s)),
                                                    source.vocab.ids(source.token_keys(s)))]
    assert 10 <= len(same) < len(sentences)
    with torch.inference_mode():
        before, after = source.embed(same).layers.numpy(), tuned.embed(same).layers.numpy()
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-5)
    result = evaluate(tuned, str(tmp_path / "data"))
    assert math.isfinite(result["average_perplexity"]) and result["tokens"] == len(text.split())
