"""layers_sha256: one digest for one model's layers, whatever files it came from."""

import torch

from elmo_pipeline import BiLM
from elmo_pipeline.model.layers_digest import layers_sha256


def test_the_original_files_and_their_import_have_one_digest_and_two_checksums(reference_model, tmp_path):
    reference_model.save_pretrained(str(tmp_path / "imported"))
    imported = BiLM.from_pretrained(str(tmp_path / "imported"))
    assert imported.checksum != reference_model.checksum  # other files
    assert layers_sha256(imported) == layers_sha256(reference_model)  # the same layers


def test_a_weight_one_ulp_off_or_another_clip_is_other_layers_and_a_name_is_not(elmo_fixture_dir):
    def load(**config_changes):
        model = BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(elmo_fixture_dir / "lm_weights.hdf5"))
        if config_changes:
            lstm = model.config.lstm.model_copy(update=config_changes.pop("lstm", {}))
            model.config = model.config.model_copy(update={"lstm": lstm, **config_changes})
        return model

    base = layers_sha256(load())
    assert layers_sha256(load()) == base
    assert layers_sha256(load(name="another name")) == base
    assert layers_sha256(load(lstm={"cell_clip": 2.5})) != base
    nudged = load()
    with torch.no_grad():
        w = nudged.lstm.layers[1].recurrent_weight
        w[0, 0, 0] = torch.nextafter(w[0, 0, 0], torch.tensor(float("inf")))
    assert layers_sha256(nudged) != base
    as_bf16 = load().to(torch.bfloat16)
    assert layers_sha256(as_bf16) != base


def test_the_softmax_is_not_part_of_the_layers_and_the_vocabulary_is():
    model = BiLM.from_pretrained(None)
    base = layers_sha256(model)
    assert model.softmax is not None
    with torch.no_grad():
        next(model.softmax.parameters()).add_(1.0)  # what training and perplexity read, not the layers
    assert layers_sha256(model) == base
    tokens = list(model.vocab.tokens)
    tokens[5], tokens[6] = tokens[6], tokens[5]  # two words' ids swapped: other rows for them
    model.vocab = type(model.vocab)(tokens)
    assert layers_sha256(model) != base
