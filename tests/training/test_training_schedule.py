"""The learning-rate schedule: torch's LambdaLR gives, at every optimizer step, the LR that the
trainer's hand-written formula set before it (the formula is restated here as the expectation)."""

import math

import pytest
import torch

from elmo_pipeline.training.optimizer import make_optimizer, make_scheduler
from elmo_pipeline.training.options import TrainArgs


def _expected_lr(optimizer: str, lr: float | None, schedule: str, warmup: int, min_ratio: float, step: int,
                 total: int | None) -> float:
    """The LR set before optimizer step `step` (1-based) by the trainer before LambdaLR:
    base * factor, the factor rising linearly over the warmup, then constant, linear or cosine
    decay to min_ratio at `total` (constant when the total is unknown)."""
    base = lr if lr is not None else (0.2 if optimizer == "adagrad" else 1e-3)
    if warmup and step <= warmup:
        return base * (step / warmup)
    if schedule == "constant" or not total:
        return base * 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return base * (min_ratio + (1.0 - min_ratio) * shape)


def _args(**kw) -> TrainArgs:
    return TrainArgs(data="unused", output="unused", **kw)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    optimizer.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()


CASES = [
    dict(optimizer="adagrad", lr=None, schedule="constant", warmup=0, min_ratio=0.0, total=None),
    dict(optimizer="adagrad", lr=None, schedule="constant", warmup=4, min_ratio=0.0, total=None),
    dict(optimizer="adam", lr=None, schedule="linear", warmup=0, min_ratio=0.0, total=17),
    dict(optimizer="adam", lr=0.01, schedule="linear", warmup=5, min_ratio=0.1, total=17),
    dict(optimizer="adagrad", lr=0.3, schedule="cosine", warmup=3, min_ratio=0.05, total=20),
    dict(optimizer="adam", lr=None, schedule="cosine", warmup=0, min_ratio=0.0, total=11),
    dict(optimizer="adagrad", lr=None, schedule="cosine", warmup=6, min_ratio=0.2, total=None),
    dict(optimizer="adam", lr=None, schedule="linear", warmup=8, min_ratio=0.0, total=5),  # total inside warmup
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['optimizer']}-{c['schedule']}-w{c['warmup']}")
def test_the_scheduler_sets_the_formula_lr_before_every_step(case):
    args = _args(optimizer=case["optimizer"], lr=case["lr"], schedule=case["schedule"],
                 warmup_steps=case["warmup"], min_lr_ratio=case["min_ratio"])
    model = _model()
    optimizer = make_optimizer(args, model)
    scheduler = make_scheduler(args, optimizer, case["total"], 0)
    seen = []
    for step in range(1, (case["total"] or 15) + 6):  # warmup, decay, the end and past it
        expected = _expected_lr(case["optimizer"], case["lr"], case["schedule"], case["warmup"], case["min_ratio"],
                                step, case["total"])
        assert optimizer.param_groups[0]["lr"] == expected, step  # exactly: the same float operations
        assert scheduler.get_last_lr() == [expected]
        seen.append(expected)
        _step(model, optimizer, scheduler)
    base = case["lr"] or (0.2 if case["optimizer"] == "adagrad" else 1e-3)
    if case["schedule"] != "constant" and case["total"]:
        assert seen[-1] == pytest.approx(base * case["min_ratio"])  # past the end: the floor
    if case["warmup"]:
        assert seen[0] < seen[case["warmup"] - 1]  # it rose


@pytest.mark.parametrize("old_checkpoint", [False, True])
def test_a_resumed_run_continues_the_schedule_at_its_step(old_checkpoint):
    args = _args(optimizer="adam", lr=0.02, schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    total, stop = 12, 6
    model = _model()
    optimizer = make_optimizer(args, model)
    scheduler = make_scheduler(args, optimizer, total, 0)
    for _ in range(stop):
        _step(model, optimizer, scheduler)
    saved = optimizer.state_dict()
    assert saved["param_groups"][0]["lr"] == _expected_lr("adam", 0.02, "cosine", 4, 0.1, stop + 1, total)
    if old_checkpoint:  # written before the scheduler: the group's lr is the last step's, no initial_lr
        for group in saved["param_groups"]:
            del group["initial_lr"]
            group["lr"] = _expected_lr("adam", 0.02, "cosine", 4, 0.1, stop, total)

    resumed_model = _model()
    resumed = make_optimizer(args, resumed_model)
    resumed.load_state_dict(saved)
    resumed_scheduler = make_scheduler(args, resumed, total, stop)
    for step in range(stop + 1, total + 3):
        expected = _expected_lr("adam", 0.02, "cosine", 4, 0.1, step, total)
        assert resumed.param_groups[0]["lr"] == expected, step
        assert optimizer.param_groups[0]["lr"] == expected, step  # the run that went straight on
        _step(resumed_model, resumed, resumed_scheduler)
        _step(model, optimizer, scheduler)


@pytest.mark.parametrize("max_steps", [None, 500])
def test_a_decay_ends_at_min_lr_when_the_data_ends_before_max_steps(tmp_path, max_steps):
    """A --max-steps past what --epochs give: the run ends with the data, and its last step runs at
    --min-lr-ratio x --lr as without --max-steps (the decay was spread over 500 steps, 8 ran)."""
    import csv

    from elmo_pipeline.corpus.records import Document
    from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
    from elmo_pipeline.training.trainer import train

    text = "".join(f"the cat number {i} sat on mat {i % 3}\n" for i in range(8))
    prepare_in_process(whitespace_sentences(Document("d", text, "d", 1)), str(tmp_path / "data"),
                       tokenizer="whitespace", lang="en", max_sentence_tokens=256)
    run = tmp_path / "run"
    result = train(TrainArgs(data=str(tmp_path / "data"), output=str(run), preset="tiny", epochs=2,
                             batch_tokens=24, max_batch_sentences=1, log_every=1, max_steps=max_steps,
                             schedule="linear", min_lr_ratio=0.25, threads=1))
    assert result["done"] and result["step"] == 16  # 8 one-sentence batches a pass, 2 passes
    with open(run / "metrics.csv", newline="") as f:
        lrs = [float(row["lr"]) for row in csv.DictReader(f) if row["kind"] == "train"]
    assert len(lrs) == 16
    assert lrs[0] == pytest.approx(0.2 * (0.25 + 0.75 * 15 / 16))  # the decay over 16 steps
    assert lrs[-1] == pytest.approx(0.2 * 0.25)  # 0.2 * (1 - 15 / 500 * 0.75) = 0.1955 before


def test_the_fewest_batches_from_the_manifest_never_exceed_the_count(tmp_path, monkeypatch):
    """A decay's last step is found without reading every shard when the manifest shows that the
    data lasts past --max-steps: the bound must hold for any batching and number of processes."""
    from support import ud_texts

    from elmo_pipeline.corpus.records import Document
    from elmo_pipeline.training.data import BatchStream
    from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
    from elmo_pipeline.training.shards import PreparedCorpus

    text = "".join(line + "\n" for line in ud_texts("ud_english_ewt", "en_ewt-ud-dev.conllu", n=400))
    prepare_in_process(whitespace_sentences(Document("d", text, "d", 1), 24), str(tmp_path / "data"),
                       tokenizer="whitespace", lang="en", max_sentence_tokens=24, shard_tokens=1500)
    corpus = PreparedCorpus(str(tmp_path / "data"))
    assert corpus.n_shards > 1
    counted = {}
    for batch_tokens, max_sentences, world in ((8, 512, 1), (26, 1, 1), (300, 512, 1), (300, 4, 3),
                                               (4096, 512, 2), (10**9, 512, 1)):
        stream = BatchStream(corpus, seed=0, batch_tokens=batch_tokens, max_sentences=max_sentences, world_size=world)
        per_shard = list(zip(stream.fewest_batches_per_shard(), stream.batches_per_shard()))
        assert all(1 <= fewest <= exact for fewest, exact in per_shard), (batch_tokens, max_sentences, world)
        fewest, exact = map(sum, zip(*per_shard))
        assert fewest >= exact / 2 or batch_tokens >= 4096, (fewest, exact)  # a bound close enough to spare the count
        counted[batch_tokens, max_sentences, world] = [n for _, n in per_shard]
    # the count reads the ids column alone: the tokens as Python strs took 15 times as long (WikiText-2 train)
    for shard in range(corpus.n_shards):
        assert corpus.shard_lengths(shard) == [len(tokens) for tokens in corpus.read_shard(shard)[0]]
    monkeypatch.setattr(corpus, "read_shard", lambda index: pytest.fail("every token read to count the batches"))
    for (batch_tokens, max_sentences, world), exact in counted.items():
        stream = BatchStream(corpus, seed=0, batch_tokens=batch_tokens, max_sentences=max_sentences, world_size=world)
        assert stream.batches_per_shard() == exact


def test_a_run_resumed_on_another_cut_of_the_batches_decays_to_its_own_last_step(tmp_path):
    """A run resumed at a shard's end with another --max-batch-sentences (or processes) counted the
    steps of a whole run in the new cut: its decay ended at step 8 where the run went on to step 12,
    every resumed step at --min-lr-ratio. The steps left are counted from the checkpoint's position."""
    import csv

    from elmo_pipeline.corpus.records import Document
    from elmo_pipeline.training.data import BatchStream
    from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
    from elmo_pipeline.training.shards import PreparedCorpus
    from elmo_pipeline.training.trainer import train

    text = "".join(f"the cat number {i} sat on mat {i % 3}\n" for i in range(16))
    prepare_in_process(whitespace_sentences(Document("d", text, "d", 1)), str(tmp_path / "data"),
                       tokenizer="whitespace", lang="en", max_sentence_tokens=256, shard_tokens=60)
    corpus = PreparedCorpus(str(tmp_path / "data"))
    one, two = (BatchStream(corpus, seed=0, batch_tokens=24, max_sentences=n) for n in (1, 2))
    order = one.shard_order(0)
    shard_end = one.batches_per_shard()[order[0]]  # one sentence a batch: the first shard's sentences
    left = sum(two.batches_per_shard()[shard] for shard in order[1:])
    assert (corpus.n_shards, shard_end, left, sum(two.batches_per_shard())) == (3, 8, 4, 8)  # a whole run: 8
    common = dict(data=str(tmp_path / "data"), output=str(tmp_path / "run"), preset="tiny", batch_tokens=24,
                  log_every=1, schedule="linear", min_lr_ratio=0.25, threads=1)
    train(TrainArgs(**common, max_batch_sentences=1, max_steps=shard_end))
    result = train(TrainArgs(**common, max_batch_sentences=2))
    assert result["done"] and result["step"] == shard_end + left
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        lrs = {int(row["step"]): float(row["lr"]) for row in csv.DictReader(f) if row["kind"] == "train"}
    for step in range(shard_end + 1, shard_end + left + 1):
        assert lrs[step] == pytest.approx(_expected_lr("adagrad", None, "linear", 0, 0.25, step, shard_end + left))
