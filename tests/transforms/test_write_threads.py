"""Whole elements between Beam's threads under `--direct_running_mode multi_threading`.

Beam's in-process gRPC workers flushed each output stream once a second from a timer thread,
wherever the writing thread was; an Arrow table's encoding lets go of the GIL midway, so a table
could be cut in two across data messages, which the runner decodes one by one. Seen here through
WriteParquet: rows missing without an error, decode errors, and a length read from the wrong bytes
that took 24 GB. Importing any of our transforms turns that timer off (transforms/data_plane.py)."""

from __future__ import annotations

import hashlib
import importlib
import time
import typing

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.testing.util import assert_that, equal_to

LOCAL_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"
WORKERS, PER_WORKER = 4, 300


class Blob:
    def __init__(self, data: bytes, slow: bool = False) -> None:
        self.data, self.slow = data, slow


class SlowCoder(beam.coders.Coder):
    """Lets go of the GIL in the middle of every element the workers write, for 5 ms, as a long
    Arrow write does: a bundle that writes for over a second is then mid-element when a timer
    flush comes. (Decoded blobs are not slow: the runner's own pass over them stays quick.)"""

    def encode(self, blob: Blob) -> bytes:
        if blob.slow:
            time.sleep(0.005)
        return blob.data

    def decode(self, encoded: bytes) -> Blob:
        return Blob(encoded)

    def is_deterministic(self) -> bool:
        return True


beam.coders.registry.register_coder(Blob, SlowCoder)


def _blobs(worker: int) -> typing.Iterator[tuple[int, Blob]]:
    for k in range(PER_WORKER):
        n = 100 + (worker * PER_WORKER + k) * 37 % 5000
        yield 0, Blob(hashlib.sha256(f"{worker}:{k}".encode()).digest() * (n // 32) + bytes([k % 256]), slow=True)


def _expected() -> list[bytes]:
    return sorted(blob.data for w in range(WORKERS) for _, blob in _blobs(w))


def test_threads_pass_whole_elements_through_a_group_by_key():
    importlib.import_module("elmo_pipeline.transforms.mix")  # any of our transforms: here one without a sink
    assert worker_handlers.DATA_BUFFER_TIME_LIMIT_MS == 0
    options = PipelineOptions([f"--runner={LOCAL_RUNNER}", "--direct_running_mode=multi_threading",
                               f"--direct_num_workers={WORKERS}"])
    with beam.Pipeline(options=options) as p:
        grouped = (p | beam.Create(range(WORKERS)) | beam.Reshuffle()
                   | beam.FlatMap(_blobs).with_output_types(typing.Tuple[int, Blob])
                   | beam.GroupByKey()
                   | beam.MapTuple(lambda key, blobs: (key, sorted(b.data for b in blobs))))
        assert_that(grouped, equal_to([(0, _expected())]))  # one key, every element once, every byte as sent
