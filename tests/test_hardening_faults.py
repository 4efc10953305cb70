"""Faults: a worker failing part-way through a bundle, broken model files, a destination that
fails part-way, and pretraining killed (SIGKILL) at random moments.

Which local runner retries: Beam 2.77's BundleBasedDirectRunner retries a failed bundle (up to 4
attempts, discarding the failed attempt's output); the FnApiRunner, the default local runner,
retries nothing: the job fails with the error, and its sinks' temporary files never reach the
final names. Distributed runners (Dataflow, Flink, Spark) retry bundles as the direct runner does.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pytest
import torch
from fsspec.implementations.memory import MemoryFile

import elmo_pipeline.transforms.read as read_transform
import elmo_pipeline.transforms.tokenize as tokenize_transform
import elmo_pipeline.transforms.write as write_transform
from elmo_pipeline import BiLM
from elmo_pipeline.formats.files import CheckpointError
from elmo_pipeline.cli.main import main as cli_main
from elmo_pipeline.commands import JobFailed
from elmo_pipeline.pipelines.extract import run
from elmo_pipeline.embedding.batch import embed_batch
from elmo_pipeline.corpus.records import Document, Sentence
from elmo_pipeline.training import checkpointing as ckpt
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.trainer import train
from elmo_pipeline.transforms.embed import ElmoModelHandler
from support import PrivateMemoryFileSystem, data_path, parse_extract_args, read_output


DIRECT_RUNNER = "--runner=apache_beam.runners.direct.direct_runner.BundleBasedDirectRunner"



@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """30 documents of two or three sentences."""
    rng = random.Random(3)
    words = "the bank rose when river water reached its old stone wall near our town".split()
    lines = []
    for i in range(30):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 14))).capitalize() + "."
                     for _ in range(rng.randint(2, 3))]
        lines.append(f"Document {i}. " + " ".join(sentences))
    path = tmp_path_factory.mktemp("corpus") / "in.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def extract(model_arg: str, src: Path, output: Path, *extra: str) -> dict:
    return run(*parse_extract_args(["--input", str(src), "--output", str(output), "--model", model_arg, "--dtype", "float32",
                       "--batch-tokens", "64", "--row-group-mb", "0.01", *extra]))




def vectors(table: pa.Table, name: str) -> np.ndarray:
    column = table.column(name).combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), -1)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, corpus, model_arg):
    out = tmp_path_factory.mktemp("clean") / "out"
    summary = extract(model_arg, corpus, out)
    assert summary["documents_reconcile"] and summary["tokens_reconcile"]
    return summary, read_output(out)


def fail_once(marker: Path, after: int):
    """A wrapper for a DoFn's process (a generator): the first time the marker file does not exist,
    it is created and the call raises after `after` outputs of this bundle (part-way)."""
    def wrap(process):
        def failing(self, element, *args, **kwargs):
            outputs = getattr(self, "_fault_outputs", 0)
            for out in process(self, element, *args, **kwargs):
                yield out
                outputs += 1
                self._fault_outputs = outputs
                if outputs >= after and not marker.exists():
                    marker.write_text("failed once")
                    raise RuntimeError(f"injected fault after {outputs} outputs")
        return failing
    return wrap


# -- a worker that fails part-way through a bundle ----------------------------------------------
def test_bundles_failing_part_way_are_retried_and_every_token_is_written_once(tmp_path, monkeypatch, corpus,
                                                                               model_arg, clean_run):
    markers = {name: tmp_path / f"{name}.failed" for name in ("read", "tokenize", "embed", "write")}
    monkeypatch.setattr(read_transform._ReadFn, "process",
                        fail_once(markers["read"], 5)(read_transform._ReadFn.process))
    monkeypatch.setattr(tokenize_transform._TokenizeFn, "process",
                        fail_once(markers["tokenize"], 10)(tokenize_transform._TokenizeFn.process))
    monkeypatch.setattr(write_transform.ToArrowTables, "process",
                        fail_once(markers["write"], 1)(write_transform.ToArrowTables.process))  # after a row group
    original = ElmoModelHandler.run_inference
    calls = []

    def run_inference(self, batch, model, inference_args=None):
        calls.append(len(batch))
        if len(calls) == 3 and not markers["embed"].exists():
            markers["embed"].write_text("failed once")
            raise RuntimeError("injected fault in the third batch")
        return original(self, batch, model, inference_args)

    monkeypatch.setattr(ElmoModelHandler, "run_inference", run_inference)
    out = tmp_path / "out"
    summary = extract(model_arg, corpus, out, DIRECT_RUNNER)
    assert all(m.exists() for m in markers.values())  # every fault fired, and the job still finished

    clean_summary, clean = clean_run
    table = read_output(out)
    ids = table.column("token_id").to_pylist()
    assert len(ids) == len(set(ids)) == clean.num_rows  # every token exactly once
    assert table.column("token_id").equals(clean.column("token_id"))
    for name in ("layer_0", "layer_1", "layer_2"):
        np.testing.assert_allclose(vectors(table, name), vectors(clean, name), rtol=0, atol=1e-6)
    # counters are added when a bundle finishes, so the failed attempts do not count
    for name in ("documents_read", "documents_tokenized", "sentences", "tokens", "token_rows_written",
                 "sentences_written"):
        assert summary[name] == clean_summary[name], name
    assert summary["documents_reconcile"] and summary["tokens_reconcile"]
    assert summary["batches"] >= clean_summary["batches"]  # the model handler's counters count every attempt
    assert sorted(p.name for p in out.iterdir()) == ["errors-00000-of-00001.jsonl", "summary.json",
                                                      "tokens-00000-of-00001.parquet"]


def test_without_retries_the_job_fails_clearly_and_leaves_no_partial_output(tmp_path, monkeypatch, corpus,
                                                                             model_arg, clean_run):
    original = ElmoModelHandler.run_inference

    def run_inference(self, batch, model, inference_args=None):
        raise RuntimeError("injected: the worker died")

    monkeypatch.setattr(ElmoModelHandler, "run_inference", run_inference)
    out = tmp_path / "out"
    with pytest.raises(JobFailed, match=r"injected: the worker died \[while running 'Embed/RunInference"):
        extract(model_arg, corpus, out)  # the FnApiRunner
    # no final name, no summary.json, and no partial shards in the sinks' temporary folders either
    assert not out.exists() or list(out.iterdir()) == []

    monkeypatch.setattr(ElmoModelHandler, "run_inference", original)
    summary = extract(model_arg, corpus, out)  # the same command again: nothing of the failed run is in its way
    assert summary["tokens_reconcile"]
    assert sorted(p.name for p in out.iterdir()) == ["errors-00000-of-00001.jsonl", "summary.json",
                                                      "tokens-00000-of-00001.parquet"]
    assert read_output(out).column("token_id").equals(clean_run[1].column("token_id"))


# -- broken model files: a clear error naming the file, before any data is read -----------------
def _flip_a_weight_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + (len(data) - header) // 2] ^= 0x40  # a tensor value, not the header
    path.write_bytes(bytes(data))


def _edit_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


NATIVE_FAULTS = {
    "missing weights": (lambda d: (d / "model.safetensors").unlink(), r"model\.safetensors: file not found"),
    "missing config": (lambda d: (d / "config.json").unlink(), r"config\.json: file not found"),
    "truncated weights": (lambda d: (d / "model.safetensors").write_bytes(
                              (d / "model.safetensors").read_bytes()[:5000]),
                          r"model\.safetensors: sha256 \w+ does not match weights_sha256 \w+ in .*config\.json"),
    "tampered weights": (lambda d: _flip_a_weight_byte(d / "model.safetensors"),
                         r"model\.safetensors: sha256 .* modified, truncated or replaced"),
    "config does not match the tensors": (
        lambda d: _edit_json(d / "config.json", lambda c: c["lstm"].update(dim=32)),
        r"model\.safetensors: tensor 'lstm\.layers\.0\.\w+' has shape \(2, 256, 16\), but lstm\.dim=32 in "
        r".*config\.json needs \(2, 128, 16\)"),
    "ill-typed config": (lambda d: _edit_json(d / "config.json", lambda c: c["lstm"].update(n_layers="2")),
                         r"config\.json: lstm\.n_layers: expected an integer, got '2'"),
}


@pytest.mark.parametrize("fault", list(NATIVE_FAULTS))
def test_broken_native_model_fails_by_name_before_any_data_is_read(fault, tmp_path, monkeypatch, reference_model,
                                                                    corpus):
    model_dir = tmp_path / "model"
    reference_model.save_pretrained(str(model_dir))
    break_it, message = NATIVE_FAULTS[fault]
    break_it(model_dir)
    reads = []
    monkeypatch.setattr(read_transform, "read_work_item", lambda *a, **k: reads.append(a) or iter(()))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=message) as caught:
        run(*parse_extract_args(["--input", str(corpus), "--output", str(out), "--model", str(model_dir)]))
    assert str(model_dir) in str(caught.value)
    assert reads == [] and not out.exists()


def test_broken_original_weights_fail_by_name(tmp_path, elmo_fixture_dir, corpus, capsys):
    weights = tmp_path / "weights.hdf5"
    weights.write_bytes((elmo_fixture_dir / "lm_weights.hdf5").read_bytes()[:20_000])
    options = elmo_fixture_dir / "options.json"
    with pytest.raises(CheckpointError, match=rf"{weights}: not a readable HDF5 file"):
        BiLM.load(f"{options},{weights}")
    mismatched = tmp_path / "options.json"
    _edit_json_copy = json.loads(options.read_text())
    _edit_json_copy["lstm"]["projection_dim"] = 8
    mismatched.write_text(json.dumps(_edit_json_copy))
    with pytest.raises(CheckpointError, match=r"lm_weights\.hdf5: tensor 'CNN_proj/W_proj' has shape"):
        BiLM.load(f"{mismatched},{elmo_fixture_dir / 'lm_weights.hdf5'}")
    # the command line: exit status 2 and one line naming the file, no traceback, no output folder
    out = tmp_path / "out"
    assert cli_main(["extract", "--input", str(corpus), "--output", str(out), "--model", f"{options},{weights}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elmo-pipeline extract: error: ") and str(weights) in err and "Traceback" not in err
    assert not out.exists()


def test_a_weights_checksum_is_written_and_older_files_without_one_still_load(tmp_path, reference_model):
    reference_model.save_pretrained(str(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    import hashlib

    assert config["weights_sha256"] == hashlib.sha256((tmp_path / "m" / "model.safetensors").read_bytes()).hexdigest()
    assert BiLM.from_pretrained(str(tmp_path / "m")).config == reference_model.config
    del config["weights_sha256"]  # a folder written before the field existed
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    BiLM.from_pretrained(str(tmp_path / "m"))


# -- a destination that fails part-way ----------------------------------------------------------
class _FailingFile(MemoryFile):
    def write(self, data):
        fs = FailingFileSystem
        room = fs.limit - fs.written
        if len(data) > room:  # write what fits, as a filling disk or a dropped upload would, then fail
            super().write(bytes(data)[:max(room, 0)])
            fs.written = fs.limit
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        fs.written += len(data)
        return super().write(data)


class FailingFileSystem(PrivateMemoryFileSystem):
    """memory:// that fails once `limit` bytes have been written (all files together). Like memory://,
    a file is visible under its name from the moment it is opened, so a partial file would show."""

    protocol = "failafter"
    store: dict = {}
    limit = 10**12
    written = 0

    def _open(self, path, mode="rb", **kwargs):
        if mode in ("wb", "w+b", "xb", "x+b"):
            f = _FailingFile(self, self._strip_protocol(path))
            f.commit()
            return f
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation(FailingFileSystem.protocol, FailingFileSystem, clobber=True)


@pytest.fixture
def failing_fs():
    fs = fsspec.filesystem(FailingFileSystem.protocol)
    root = f"/{uuid.uuid4().hex}"
    FailingFileSystem.written, FailingFileSystem.limit = 0, 10**12

    def files():
        return sorted(p.rsplit("/", 1)[-1] for p in fs.find(root))

    yield fs, f"{FailingFileSystem.protocol}://{root}", files
    FailingFileSystem.limit = 10**12
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_save_pretrained_to_a_failing_destination(failing_fs, reference_model):
    fs, root, files = failing_fs
    FailingFileSystem.limit = 5000  # in the middle of model.safetensors
    with pytest.raises(OSError, match=rf"cannot write {root}/m/model\.safetensors: .*No space left") as caught:
        reference_model.save_pretrained(f"{root}/m")
    assert caught.value.errno == errno.ENOSPC
    assert files() == []  # no partial file under a final name, and no temporary left

    # an earlier complete model in the folder, and a save of other weights failing at config.json:
    # the new weights are in place but the old config's checksum refuses them, by name
    FailingFileSystem.limit, FailingFileSystem.written = 10**12, 0
    reference_model.save_pretrained(f"{root}/m")
    other = BiLM.from_pretrained(f"{root}/m")
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    size = len(fs.cat(f"{root}/m/model.safetensors"))
    FailingFileSystem.limit, FailingFileSystem.written = size + 100, 0
    with pytest.raises(OSError, match=r"config\.json"):
        other.save_pretrained(f"{root}/m")
    assert files() == ["config.json", "model.safetensors"]
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 .* does not match"):
        BiLM.from_pretrained(f"{root}/m")


def test_embed_file_to_a_failing_destination(failing_fs, tmp_path, elmo_fixture_dir, capsys, monkeypatch):
    _, root, files = failing_fs
    src = tmp_path / "in.txt"
    src.write_text("The cat sat .\n" * 200)
    FailingFileSystem.limit = 20_000
    scratch = tmp_path / "tmp"  # this test's own temp folder: other tests may run beside it (pytest -n)
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    status = cli_main(["embed-file", str(src), f"{root}/out.hdf5", "--quiet",
                       "--options", str(elmo_fixture_dir / "options.json"),
                       "--weights", str(elmo_fixture_dir / "lm_weights.hdf5")])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elmo-pipeline embed-file: error: [Errno 28] cannot write {root}/out.hdf5")
    assert files() == []  # neither out.hdf5 nor out.hdf5.partial
    assert os.listdir(scratch) == []  # the local file it wrote before the copy is gone too


def test_embed_file_failing_locally_leaves_no_file(tmp_path, monkeypatch, model_arg):
    from elmo_pipeline.embedding import hdf5_file as embed_file

    model = BiLM.load(model_arg)  # its own: embed_file fills the word cache under inference_mode

    src = tmp_path / "in.txt"
    src.write_text("One two .\n" * 100)
    calls = []

    def select(layers, mode):
        calls.append(1)
        if len(calls) == 50:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return layers

    monkeypatch.setattr(embed_file, "_select", select)
    with pytest.raises(OSError, match="injected"):
        embed_file.embed_file(model, str(src), str(tmp_path / "out.hdf5"), batch_size=8, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_extract_output_failing_part_way_leaves_no_file_under_a_final_name(tmp_path, monkeypatch, corpus, model_arg,
                                                                             capsys):
    from apache_beam.io.localfilesystem import LocalFileSystem

    create = LocalFileSystem.create

    class Failing:
        def __init__(self, f):
            self._f, self._left = f, 3000

        def write(self, data):
            if len(data) > self._left:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            self._left -= len(data)
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def failing_create(self, path, *args, **kwargs):
        f = create(self, path, *args, **kwargs)
        return Failing(f) if "tokens" in path else f

    monkeypatch.setattr(LocalFileSystem, "create", failing_create)
    out = tmp_path / "out"
    status = cli_main(["extract", "--input", str(corpus), "--output", str(out), "--model", model_arg,
                       "--row-group-mb", "0.01"])
    assert status == 1  # a job that failed, not a user's error
    err = capsys.readouterr().err
    assert "elmo-pipeline extract: the job failed: " in err
    assert "OSError: [Errno 28] No space left on device (injected)" in err and "WriteParquet" in err
    # the partial shard went with its temporary folder, and the folder made for the run with it
    assert not out.exists()


# -- out of memory: the failed batch is freed before its halves run -----------------------------
class OomAboveLimit(BiLM):
    """A real BiLM that, as CUDA does with a batch that does not fit, computes part of a batch of
    more than `limit` sentences and then raises out-of-memory. At each call that fits it records
    the exception being handled and whether the tensors of the failed calls are still alive."""

    limit = 2

    def embed(self, sentences, state=None):
        if len(sentences) > self.limit:
            partial = super().embed(sentences, state)  # held by this frame, hence by the traceback
            self.failed_outputs.append(weakref.ref(partial.layers))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.seen_at_halves.append((sys.exc_info(), [ref() is not None for ref in self.failed_outputs]))
        return super().embed(sentences, state)


def test_out_of_memory_split_runs_the_halves_after_the_failed_batch_is_freed(reference_model):
    model = OomAboveLimit(reference_model.config, reference_model.vocab).eval()
    model.load_state_dict(reference_model.state_dict())
    model.failed_outputs, model.seen_at_halves = [], []
    texts = ["The bank rose .", "A river ran by the old stone wall .", "Hello !", "Water reached our town .",
             "She said that it would .", "Near the wall", "Old"]
    sentences = [Sentence("d", i, 0, tuple(t.split()), np.zeros(0, np.int64), np.zeros(0, np.int64))
                 for i, t in enumerate(texts)]
    splits: list[int] = []
    out = embed_batch(model, sentences, on_split=splits.append)

    assert splits == [7, 3, 4]  # 7 -> 3 + 4, 3 -> 1 + 2, 4 -> 2 + 2
    assert len(model.failed_outputs) == 3 and len(model.seen_at_halves) == 4  # 1 + 2, 2 + 2
    for exc_info, alive in model.seen_at_halves:
        assert exc_info == (None, None, None)  # not inside the handler of the failed batch
        assert not any(alive)  # its tensors were freed (by reference counting, no gc needed)
    assert [e.sentence.key for e in out] == [s.key for s in sentences]  # none lost, in order
    for e, s in zip(out, sentences):
        with torch.inference_mode():
            alone = reference_model.embed([list(s.tokens)]).layers[:, 0].numpy()
        np.testing.assert_allclose(e.layers, alone, rtol=0, atol=1e-6)


# -- pretraining killed at random moments -------------------------------------------------------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """~4,000 tokens of WikiText-2 valid in 3 shards."""
    lines = []
    with open(data_path("wikitext2", "wiki.valid.tokens"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= 120:
                break
            if line.strip():
                lines.append(line)
    folder = tmp_path_factory.mktemp("prepared") / "train"
    doc = Document("sample", "".join(lines), "sample", 1)
    prepare_in_process(whitespace_sentences(doc, 40), str(folder), tokenizer="whitespace", lang="en",
                       max_sentence_tokens=40, unk_alias="<unk>", shard_tokens=1500)
    return folder


def test_pretraining_killed_several_times_at_random_moments_ends_with_the_same_weights(prepared, tmp_path):
    common = dict(preset="tiny", epochs=40, max_steps=40, batch_tokens=300, checkpoint_every=3, log_every=1,
                  seed=11, threads=1, optimizer="adam", dropout=0.1)
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "elmo_pipeline.cli.training", "pretrain", "--data", str(prepared),
           "--output", str(run_dir)] + [
        arg for key, value in common.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    rng = random.Random(7)
    kills = []
    for attempt in range(3):  # the same command each time, killed at a random moment of its training
        found = ckpt.list_checkpoints(str(run_dir))
        resumed_at = found[-1][0] if found else 0
        target = resumed_at + rng.randint(1, 5)  # a step of this attempt; then up to 40 ms more
        log = tmp_path / f"attempt{attempt}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
            deadline = time.time() + 120
            while time.time() < deadline and proc.poll() is None:
                steps = [int(n) for n in re.findall(r"^step (\d+) \|", log.read_text(), re.MULTILINE)]
                if steps and max(steps) >= target:
                    break
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.04))  # mid-step, mid-checkpoint, mid-rename...
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL, log.read_text()[-2000:]
        kills.append((resumed_at, target))
    assert not (run_dir / "model").exists()  # no attempt got to the end
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    train(TrainArgs(data=str(prepared), output=str(tmp_path / "straight"), **common))
    a = BiLM.from_pretrained(str(tmp_path / "straight" / "model")).state_dict()
    b = BiLM.from_pretrained(str(run_dir / "model")).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not any(n.startswith(".tmp-") for n in os.listdir(run_dir / "checkpoints"))
    # the metrics of steps redone after a kill appear once
    steps = [int(r.split(",")[1]) for r in (run_dir / "metrics.csv").read_text().splitlines()[1:]
             if r.startswith("train")]
    assert steps == sorted(set(steps)) and steps[-1] == 40


# -- what the wheel ships -------------------------------------------------------------------------
def test_the_installed_packages_hold_no_test_support():
    # elmo_pipeline/testing.py imported pytest and found the data folder relative to its own
    # path, which outside a checkout pointed into site-packages' parent; it now lives in tests/.
    import elmo_pipeline.pipelines
    import elmo_pipeline.transforms

    roots = {Path(m.__file__).parent for m in (elmo_pipeline, elmo_pipeline.pipelines, elmo_pipeline.transforms)}
    sources = [p for root in roots for p in root.rglob("*.py")]
    assert len(sources) > 40
    assert [p for p in sources if re.search(r"^\s*(import|from)\s+pytest\b", p.read_text(), re.M)] == []
    assert not any(p.name == "testing.py" for p in sources)
