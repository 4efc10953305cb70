"""From the audit of probe's labelled files with hostile data: files of two formats, and CoNLL-U
fields that would make another label or token than the one meant."""

import pytest

from elmo_pipeline.cli.main import main
from elmo_pipeline.downstream.conll import ConllError, common_format
from support import data_path

ELMO = data_path("allennlp_elmo")
MODEL = f"{ELMO / 'options.json'},{ELMO / 'lm_weights.hdf5'}"


def conllu_line(number, form, upos, xpos="_"):
    return f"{number}\t{form}\t{form.lower()}\t{upos}\t{xpos}\t_\t0\troot\t_\t_\n"


def test_train_and_dev_files_of_two_formats_are_refused_before_any_work(tmp_path, capsys):
    """A CoNLL-U dev file beside a CoNLL-2003 train file was read as CoNLL-2003, the train file's
    format: its IDs were the tokens and its MISC column the labels, and every probe scored 0.00%
    (exit 0; measured on 8 EWT dev sentences, 151 tokens)."""
    train = tmp_path / "train.txt"
    train.write_text("The DET\ndog NOUN\nbarks VERB\n\nA DET\ncat NOUN\n", encoding="utf-8")
    dev = tmp_path / "dev.conllu"
    dev.write_text(conllu_line(1, "The", "DET") + conllu_line(2, "cat", "NOUN") + "\n", encoding="utf-8")
    assert common_format({"train": str(train), "train again": str(train)}) == "conll2003"
    with pytest.raises(ConllError) as caught:
        common_format({"train": str(train), "dev": str(dev)})
    assert str(caught.value) == (f"the labelled files are not of one format (train file {train} reads as conll2003, "
                                 f"dev file {dev} reads as conllu): give them in one format")
    out = tmp_path / "out"
    assert main(["probe", "--train", str(train), "--dev", str(dev), "--output", str(out), "--model", MODEL]) == 2
    assert str(caught.value) in capsys.readouterr().err
    assert not out.exists()  # before the extraction
