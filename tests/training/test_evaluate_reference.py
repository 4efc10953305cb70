"""`evaluate`'s perplexities against a direct computation: every prediction's log probability read
from the model's full softmax, in float64, one sentence at a time."""

import json
import math

import torch

from elmo_pipeline import BiLM
from elmo_pipeline.cli.training import main
from support import data_path


def _reference_nll(model: BiLM, sentences: list[list[str]]) -> tuple[float, float, int]:
    """Summed forward and backward NLL and the predictions per direction, one sentence at a time."""
    vocab, forward, backward, n = model.vocab, 0.0, 0.0, 0
    with torch.no_grad():
        for words in sentences:
            tokens, lengths = model.sentence_tokens([words])
            layers, _ = model(tokens, lengths)
            top = layers[-1][:, 0]  # (2, n+2, P): <S> w_1 .. w_n </S>
            targets = torch.tensor([vocab.start_id, *vocab.ids(words).tolist(), vocab.end_id])
            steps = torch.arange(len(targets) - 1)
            # forward predicts position t+1 from t, backward t from t+1
            forward -= float(model.softmax.log_probs(top[0].float()).double()[steps, targets[1:]].sum())
            backward -= float(model.softmax.log_probs(top[1].float()).double()[steps + 1, targets[:-1]].sum())
            n += len(steps)
    return forward, backward, n


def test_perplexities_are_those_of_the_full_softmax_per_prediction(tmp_path, capsys):
    lines = [line for line in data_path("wikitext2", "wiki.valid.tokens").read_text(encoding="utf-8").split("\n")
             if line.strip() and len(line.split()) <= 60][:10]
    (tmp_path / "held.txt").write_text("\n\n".join(lines) + "\n", encoding="utf-8")  # blank lines are no sentences
    assert main(["evaluate", "--data", str(tmp_path / "held.txt"), "--batch-tokens", "700", "--threads", "1"]) == 0
    got = json.loads(capsys.readouterr().out)
    forward, backward, n = _reference_nll(BiLM.from_pretrained().eval(), [line.split() for line in lines])
    assert (got["sentences"], got["tokens"], got["predictions_per_direction"]) == (10, n - 10, n)
    assert math.isclose(got["forward_perplexity"], math.exp(forward / n), rel_tol=1e-6)
    assert math.isclose(got["backward_perplexity"], math.exp(backward / n), rel_tol=1e-6)
    assert math.isclose(got["average_perplexity"], math.exp((forward + backward) / (2 * n)), rel_tol=1e-6)


def test_words_outside_the_vocabulary_are_counted(tmp_path, capsys):
    """Every word the vocabulary lacks is scored as <UNK>, one class: Chinese text read by the
    English default model had a perplexity of 19.3 (WikiText-2 test: 129.2), and nothing said
    that its words were nearly all unknown to the model."""
    chinese = ["我 们 喜欢 这 本 书 。", "北京 是 中国 的 首都 。"]
    english = [line for line in data_path("wikitext2", "wiki.valid.tokens").read_text(encoding="utf-8").split("\n")
               if "<unk>" in line and len(line.split()) <= 60][:3]
    (tmp_path / "held.txt").write_text("\n".join(chinese + english) + "\n", encoding="utf-8")
    assert main(["evaluate", "--data", str(tmp_path / "held.txt"), "--threads", "1"]) == 0
    got = json.loads(capsys.readouterr().out)
    vocab = BiLM.from_pretrained().vocab
    unknown = [word for line in chinese + english for word in line.split() if word not in vocab.index]
    assert "<unk>" in unknown and "北京" in unknown  # WikiText's own unknown word is ours too
    assert got["unknown_tokens"] == len(unknown) and got["tokens"] == sum(len(s.split()) for s in chinese + english)


def test_the_perplexities_are_the_same_bits_whatever_the_batches(tmp_path, capsys):
    """Each batch's NLL was summed in float32, so the perplexities moved in their 7th digit with
    --batch-tokens (158.74648 at 100, 158.74643 at 8192); and the output layer's products ran over
    a batch's predictions (the adaptive softmax's clusters over those whose targets fall in them),
    a row count that gave some predictions other last bits. Each prediction's NLL is now the same
    bits in any batch (products over fixed tiles of rows) and their sum is exact."""
    lines = [line for line in data_path("wikitext2", "wiki.valid.tokens").read_text(encoding="utf-8").split("\n")
             if line.strip()][:60]  # sentences of 4 to 268 words, headings among them
    (tmp_path / "held.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    runs = []
    for budget in ("100", "700", "8192"):
        assert main(["evaluate", "--data", str(tmp_path / "held.txt"), "--batch-tokens", budget, "--threads", "1"]) == 0
        got = json.loads(capsys.readouterr().out)
        runs.append({k: v for k, v in got.items() if k.endswith(("perplexity", "nll"))})
    assert len(runs[0]) == 5 and runs[0] == runs[1] == runs[2]
