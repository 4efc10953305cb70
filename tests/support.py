"""Helpers shared by several test modules (pytest puts this folder on sys.path)."""

from __future__ import annotations

import argparse
import functools
import gzip
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from benchmarks.common import DATA_ENV, shared_data_dir
from elmo_pipeline.embedding.options import add_extract_args
from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig, LstmConfig, SoftmaxConfig
from elmo_pipeline.model.vocabulary import Vocabulary


@functools.cache
def loader_socket_name() -> str:
    """`dataset.socket_name()` asked of a child Python: in the suite's process the multiprocessing temp
    folder it makes outlives the suite's temp folder, and its removal at exit fails."""
    ask = "from elmo_pipeline.downstream.dataset import socket_name; print(socket_name())"
    return subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True).stdout.strip()


def skip_unless_loader_workers_fit() -> None:
    """Skips a test of DataLoader workers where the temp folder leaves no room for the socket a worker
    hands its batches over by (a user's $TMPDIR of 56 characters or more, under the suite's own
    folder), naming it as ParquetFeatureDataset's workers refuse it: there the loader used to wait
    for good."""
    from elmo_pipeline.downstream.dataset import _check_socket_room

    try:  # a worker's folder and socket, named as multiprocessing names them, not made in this process
        _check_socket_room(0, os.path.join(tempfile.gettempdir(), "pymp-XXXXXXXX"), loader_socket_name())
    except OSError as exc:
        pytest.skip(str(exc))


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, so that progress bars draw into it."""

    def isatty(self) -> bool:
        return True


def damaged_gzip(data: bytes) -> bytes:
    """`data` gzipped with a byte flipped inside its deflate stream: zlib fails with error -3
    as it reaches it, after the lines before the damage were read."""
    damaged = bytearray(gzip.compress(data, mtime=0))
    damaged[len(damaged) // 2] ^= 0xFF
    return bytes(damaged)


def data_path(*parts: str) -> Path:
    """A file or folder of the shared data; skips the calling test when it is absent, fails under CI=true."""
    path = shared_data_dir().joinpath(*parts)
    if not path.exists():
        reason = f"shared data {path} is absent (set {DATA_ENV} to its folder)"
        if os.environ.get("CI", "").lower() == "true":
            raise FileNotFoundError(reason)
        pytest.skip(reason)
    return path


def ud_texts(*parts: str, n: int) -> list[str]:
    """The first `n` sentence texts ("# text = " lines) of a UD treebank file."""
    texts = []
    with open(data_path(*parts), encoding="utf-8") as f:
        for line in f:
            if line.startswith("# text = "):
                texts.append(line[len("# text = "):].rstrip("\n"))
                if len(texts) == n:
                    break
    return texts


def read_output(output: Path | str, layout: str = "token") -> pa.Table:
    """extract's Parquet shards in `output`, read back and sorted by token_id (sentence_id)."""
    fs, root = fsspec.core.url_to_fs(str(output))
    files = sorted(fs.glob(f"{root}/{layout}s-*.parquet"))
    assert files, f"no {layout} shards in {output}"
    tables = []
    for path in files:
        with fs.open(path, "rb") as f:
            tables.append(pq.read_table(f))
    table = pa.concat_tables(tables)
    key = "token_id" if layout == "token" else "sentence_id"
    return table.sort_by(key)


def vector_column(table: pa.Table, name: str) -> np.ndarray:
    """A fixed_size_list column as an (n, width) array of its stored dtype."""
    column = table.column(name).combine_chunks()
    width = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def parse_extract_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """`extract`'s own options and the rest (Beam's), as the command line splits them."""
    parser = argparse.ArgumentParser()
    add_extract_args(parser)
    return parser.parse_known_args(argv)


class PrivateMemoryFileSystem(MemoryFileSystem):
    """memory:// under another protocol, with its own store: a base for filesystems that
    misbehave on purpose. Subclasses set `protocol` and `store = {}`."""

    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        path = path[len(cls.protocol) + 3:] if path.startswith(cls.protocol + "://") else path
        return MemoryFileSystem._strip_protocol(path)  # which knows only "memory://"


def long_text(n_chars: int, seed: int = 0) -> str:
    """Sentences of real-looking words with varied punctuation and whitespace, on one line."""
    rng = random.Random(seed)
    words = ["the", "bank", "rose", "Ireland", "@-@", "<unk>", "(", ")", "1,024", "don't", "U.S.", "e.g.", "naïve",
             "北京", "🙂", "—", '"', "'s", "x" * 30]
    parts, length = [], 0
    while length < n_chars:
        parts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 70))))
        parts.append(rng.choice([" .", ".", "!", "?", "", ",", '. "', "?!", " ..."]))
        parts.append(rng.choice([" ", "  ", " \t ", "\u3000"]))
        length += sum(len(p) for p in parts[-3:])
    return "".join(parts)[:n_chars]


@contextmanager
def thread_switches_every(seconds: float) -> Iterator[None]:
    """Python hands the GIL to another thread every 5 ms, and a race between two lines of Python
    shows in few runs; switching every 10 us (1 us: at almost every bytecode) shows it in most."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run_threads(work: Callable[[int], object], count: int) -> None:
    """work(0) .. work(count - 1), each in a thread of its own, all at once; returns when all have ended."""
    threads = [threading.Thread(target=work, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def strict_json(text: str | bytes):
    """json.loads as a strict parser (Java's, Go's, JavaScript's) reads: NaN and Infinity are errors."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


class _Payload:
    """Unpickling this creates the file `path`: proof that something was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_bomb(path: Path, marker: Path, **save_options) -> Path:
    """A torch.save file (a pickle) holding a tensor and the payload; `save_options` go to torch.save."""
    torch.save({"token_encoder.projection.weight": torch.zeros(2, 2), "x": _Payload(marker)}, path, **save_options)
    return path


def lose_the_first_text_record(monkeypatch) -> None:
    """Beam's text sink (errors-*.jsonl, errors.jsonl) made to lose the first record it is given,
    as a runner losing output after the job counted it would."""
    from apache_beam.io import textio

    keep, given = textio._TextSink.write_encoded_record, []

    def drop_the_first(self, file_handle, encoded_value):
        given.append(encoded_value)
        if len(given) != 1:
            keep(self, file_handle, encoded_value)

    monkeypatch.setattr(textio._TextSink, "write_encoded_record", drop_the_first)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # a client that hung up (its read cut short or timed out on purpose) printed a traceback to
        # stderr, where a test reads a command's message
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HttpServer:
    """A real HTTP server in a thread, for fsspec's HTTP file system and aiohttp: serves the files
    of `root` at /ok/<name> (with Range) and, for the names in `faults`, something else: a status
    code, a body cut short, a Content-Length it does not keep, silence, or the file slowly.
    Every request is logged as (method, path); `close` ends it."""

    def __init__(self, root: Path) -> None:
        self.root, self.faults, self.requests = root, {}, []
        self.closing = threading.Event()  # releases the requests left unanswered
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # the requests are recorded, not printed
                pass

            def do_HEAD(self):
                server.answer(self, head=True)

            def do_GET(self):
                server.answer(self, head=False)

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        path = handler.path.split("?")[0]
        self.requests.append((handler.command, handler.path))
        if path.startswith("/moved/"):  # a redirect to the same file under /ok/
            return self._send(handler, 302, b"", head, {"Location": "/ok/" + path[len("/moved/"):]})
        name = path[len("/ok/"):]
        fault = self.faults.get(name)
        file = self.root / name
        if fault == "silent":  # takes the request and never answers
            self.closing.wait()
            return
        if isinstance(fault, int):
            return self._send(handler, fault, b"server says no", head)
        if not path.startswith("/ok/") or not file.is_file():
            return self._send(handler, 404, b"not here", head)
        data = file.read_bytes()
        if fault == "declares-100-GB":  # then closes after the true bytes (a read of them fails at once)
            handler.close_connection = True
            return self._send(handler, 200, data, head, length=100 * 10**9)
        if fault == "slow":  # the whole file, in 8 pieces 0.2 s apart: 1.4 s in all
            return self._send(handler, 200, data, head, pieces=8)
        if fault == "cut-short":  # the connection closes half way through the body
            handler.close_connection = True
            return self._send(handler, 200, data, head, sent=len(data) // 2)
        self._send(handler, 200, data, head)

    @staticmethod
    def _send(handler, status, data, head, headers=None, length=None, sent=None, pieces=1):
        start, end = 0, len(data)
        wanted = handler.headers.get("Range")
        if wanted and status == 200 and length is None:
            first, _, last = wanted.split("=")[1].partition("-")
            start, end = int(first), min(int(last) + 1, len(data)) if last else len(data)
            status = 206
        handler.send_response(status)
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(length if length is not None else end - start))
        if status == 206:
            handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        handler.end_headers()
        if not head:
            body = data[start:end][:sent]
            step = -(-len(body) // pieces)
            for first in range(0, len(body), step):
                if first:
                    time.sleep(0.2)
                handler.wfile.write(body[first:first + step])
                handler.wfile.flush()

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


# every kind of model (token encoder, softmax), for the tests that build each one's shapes
MODEL_KINDS = [("char_cnn", "none"), ("word", "full"), ("char_cnn+word", "sampled"), ("char_cnn+word", "adaptive")]


def small_model_config(encoder: str, softmax: str) -> tuple[ElmoConfig, Vocabulary | None]:
    """A small config of one of MODEL_KINDS and the vocabulary it takes (None where it takes none)."""
    cnn = CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 8)), n_highway=1)
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", *(f"w{i}" for i in range(40))])
    config = ElmoConfig(lstm=LstmConfig(dim=8, projection_dim=4, n_layers=2), char_cnn=None if encoder == "word" else cnn,
                        token_encoder=encoder, word_embedding_dim=None if encoder == "char_cnn" else 6,
                        vocab_size=len(vocab) if (encoder != "char_cnn" or softmax != "none") else None,
                        softmax=SoftmaxConfig(kind=softmax))
    return config, vocab if config.vocab_size else None
