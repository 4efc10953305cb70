"""DistributedDataParallel through torchrun: 2 CPU processes over gloo, then resumption."""

import json
import os
import subprocess
import sys

import torch

from elmo_pipeline import BiLM
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.training.data import BatchStream, Position
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.shards import PreparedCorpus
from support import data_path


def _torchrun(data, out, max_steps):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "elmo_pipeline.cli.training", "pretrain", "--data", str(data), "--output", str(out),
           "--preset", "tiny", "--epochs", "20", "--max-steps", str(max_steps), "--batch-tokens", "300",
           "--checkpoint-every", "100", "--device", "cpu", "--threads", "1", "--optimizer", "adam",
           "--dropout", "0.2", "--softmax", "sampled", "--n-samples", "30"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _small_corpus(tmp_path):
    """80 lines of WikiText-2 valid, prepared in shards of about 1,000 tokens."""
    with open(data_path("wikitext2", "wiki.valid.tokens"), encoding="utf-8") as f:
        text = "".join(line for i, line in enumerate(f) if i < 80)
    data = tmp_path / "data"
    prepare_in_process(whitespace_sentences(Document("d", text, "d", 1), 40), str(data), tokenizer="whitespace",
                       lang="en", max_sentence_tokens=40, unk_alias="<unk>", shard_tokens=1000)
    return data


def test_two_processes_train_and_resume(tmp_path):
    data = _small_corpus(tmp_path)
    run = tmp_path / "run"
    done = _torchrun(data, run, 3)
    assert "2 process(es)" in done.stderr
    assert json.loads(done.stdout)["step"] == 3  # rank 0's result only: one JSON document, not one per process
    names = os.listdir(run / "checkpoints" / "step-000000003")
    assert {"rng-rank00000.safetensors", "rng-rank00001.safetensors"} <= set(names)
    # the same command line (but max-steps) continues from step 3: both processes restore
    # their own random state and data position (exactness is tested in one process in
    # test_training.py; the distributed path saves and restores the same state per rank)
    done = _torchrun(data, run, 6)
    assert "resuming from" in done.stderr and "step-000000003" in done.stderr
    assert json.loads(done.stdout)["step"] == 6
    model = BiLM.from_pretrained(str(run / "model"))
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[-1].startswith("train,6,")


def test_every_batch_of_a_shard_goes_to_some_process_in_equal_shares(tmp_path):
    """The remainder of a shard's batches was dropped: with 2 processes one of 5 batches was never
    trained, and a corpus of one batch gave every process none (the run finished at step 0)."""
    text = "".join(f"sentence number {i} {'word ' * i}\n" for i in range(5))
    prepare_in_process(whitespace_sentences(Document("d", text, "d", 1), 40), str(tmp_path / "five"),
                       tokenizer="whitespace", lang="en", max_sentence_tokens=40)
    prepare_in_process(whitespace_sentences(Document("d", "just one sentence\n", "d", 1), 40), str(tmp_path / "one"),
                       tokenizer="whitespace", lang="en", max_sentence_tokens=40)
    for name, world, sentences in (("five", 2, 5), ("one", 2, 1), ("one", 3, 1), ("five", 1, 5)):
        corpus = PreparedCorpus(str(tmp_path / name))
        shares = []
        for rank in range(world):
            stream = BatchStream(corpus, seed=7, batch_tokens=1000, max_sentences=1, rank=rank, world_size=world)
            shares.append([" ".join(words) for batch, _, _ in stream.iterate(Position(), epochs=1) for words in batch])
        per_process = -(-sentences // world)
        assert [len(share) for share in shares] == [per_process] * world, (name, world)
        seen = [s for share in shares for s in share]
        assert len(set(seen)) == sentences  # every sentence trained; the last round repeats the first ones
        assert sum(stream.batches_per_shard()) == per_process


def test_a_one_process_run_resumes_on_two_at_a_shard_end(tmp_path):
    """More processes than the checkpoint's run had, at a shard's end (which the README says is
    taken): the new process found no random state of its own and the run stopped with 'checkpoint
    ... cannot be read; delete that folder', advice that threw a sound checkpoint away."""
    from elmo_pipeline.training.options import TrainArgs
    from elmo_pipeline.training.trainer import train

    data = _small_corpus(tmp_path)
    corpus = PreparedCorpus(str(data))
    stream = BatchStream(corpus, seed=0, batch_tokens=300)
    first = int(stream.shard_order(0)[0])
    shard_end = len(stream.my_batches(0, first, [len(t) for t in corpus.read_shard(first)[0]]))
    run = tmp_path / "run"
    # the options of _torchrun, in one process, stopped where the first shard ends
    train(TrainArgs(data=str(data), output=str(run), preset="tiny", epochs=20, max_steps=shard_end,
                    batch_tokens=300, checkpoint_every=100, device="cpu", threads=1, optimizer="adam", dropout=0.2,
                    softmax="sampled", n_samples=30, log_every=1))
    done = _torchrun(data, run, shard_end + 2)
    assert f"resuming from {run}/checkpoints/step-{shard_end:09d}" in done.stderr
    assert json.loads(done.stdout)["step"] == shard_end + 2
    state = json.loads((run / "checkpoints" / f"step-{shard_end + 2:09d}" / "trainer_state.json").read_text())
    assert state["batching"]["processes"] == 2
    assert state["position"] == {"epoch": 0, "shard_pos": 1, "batch_pos": 2}  # two batches of the second shard
    steps = [int(row.split(",")[1]) for row in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == [*range(1, shard_end + 1), shard_end + 2]  # every step once: the last row is the final one
