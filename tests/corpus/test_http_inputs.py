"""Inputs read over real HTTP (fsspec's HTTP file system and aiohttp) from a server in the test:
read as the model files are, with the same time limits, and each way a server fails named in
the error with the URL and why."""

import io
import sys
import zipfile

import aiohttp.client
import pytest
from fsspec.implementations.http import HTTPFileSystem

from elmo_pipeline import filesystems
from elmo_pipeline.cli.main import main
from elmo_pipeline.corpus.byte_ranges import WorkItem
from elmo_pipeline.corpus.input_files import InputError, expand_patterns, magic_compression
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import read_work_item
from elmo_pipeline.corpus.records import Document, ErrorRecord
from elmo_pipeline.embedding.hdf5_file import read_sentences
from elmo_pipeline.formats.files import CheckpointError, read_bytes
from support import HttpServer

LINES = [f"Sentence number {i} is here ." for i in range(40)]


@pytest.fixture
def served(tmp_path):
    """The server, serving tmp_path/www, which holds in.txt (LINES)."""
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "in.txt").write_text("".join(line + "\n" for line in LINES))
    server = HttpServer(tmp_path / "www")
    yield server
    server.close()


def _zip_of(name: str, text: str) -> bytes:
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as archive:
        archive.writestr(name, text)
    return data.getvalue()


def _read(url: str) -> list:
    """What `extract` and `prepare` make of the file: its documents' texts and its error records."""
    return [r.text if isinstance(r, Document) else r for r in read_work_item(WorkItem(url), ReadOptions())]


def test_a_server_failing_an_input_is_named_with_the_url_and_why(served, tmp_path, capsys):
    """An HTTP 500 or 403 was 'FileNotFoundError: URL' (fsspec's error for any failed request
    for the size) in the error record and embed-file's message, and a traceback (aiohttp's
    ClientResponseError) when the input pattern was expanded; a body cut short was aiohttp's
    ClientPayloadError, no OSError, out of the reader: a failed worker, not an error record."""
    url = f"{served.url}/ok/in.txt"
    assert _read(url) == LINES
    for fault, why in ((500, "HTTP 500 Internal Server Error"), (403, "HTTP 403 Forbidden"),
                       ("cut-short", "ClientPayloadError: Response payload is not completed")):
        served.faults = {"in.txt": fault}
        named = f"{url}: cannot be read ({why}"
        [record] = _read(url)
        assert isinstance(record, ErrorRecord) and record.source == url and record.line is None
        assert record.reason.startswith(f"cannot read file: RemoteReadError: {named}"), record.reason
        with pytest.raises(OSError, match="RemoteReadError") as caught:
            read_sentences(url)
        assert named in str(caught.value)
        out = tmp_path / "out.hdf5"
        assert main(["embed-file", url, str(out)]) == 2
        err = capsys.readouterr().err
        assert named in err and "Traceback" not in err and len(err.splitlines()) == 1
        assert not out.exists()
        if fault != "cut-short":  # the size is asked for first: the pattern is refused before any work
            with pytest.raises(InputError, match=f"cannot list input pattern '{url}': ") as caught:
                expand_patterns([url])
            assert named in str(caught.value)
    # a 404 is a file not there, as it was
    served.faults = {"in.txt": 404}
    with pytest.raises(InputError, match="matches no files"):
        expand_patterns([url])
    [record] = _read(url)
    assert record.reason == f"cannot read file: FileNotFoundError: {url}"


def test_a_silent_input_server_fails_the_read_and_a_slow_one_is_waited_for(served, monkeypatch):
    """Inputs kept aiohttp's own limit of 300 s a request (model files had 60 s without a byte
    and no total): a server that never answers held each read 5 minutes (then 'file not found'),
    and an input taking over 5 minutes to come could not be read. With aiohttp's limit made
    0.5 s here, the input's own limits are the ones that hold: a silent server fails the read
    after HTTP_READ_TIMEOUT_S (1 s here) without a byte, and a file that keeps coming for 1.4 s is
    read whole (a server thread held up by a loaded machine has 0.8 s beside the pieces' 0.2 s)."""
    monkeypatch.setattr(filesystems, "HTTP_READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(aiohttp.client, "DEFAULT_TIMEOUT", aiohttp.ClientTimeout(total=0.5))
    HTTPFileSystem.clear_instance_cache()  # a file system made earlier keeps its session, and its limits
    url = f"{served.url}/ok/in.txt"
    served.faults = {"in.txt": "slow"}  # 8 pieces 0.2 s apart
    assert _read(url) == LINES
    assert read_sentences(url) == LINES
    served.faults = {"in.txt": "silent"}
    [record] = _read(url)
    assert record.reason.startswith(f"cannot read file: RemoteReadError: {url}: cannot be read (SocketTimeoutError: ")
    with pytest.raises(OSError, match="SocketTimeoutError"):
        read_sentences(url)


def test_a_server_error_under_a_chain_is_named_not_taken_for_no_file(served):
    """Through a cache (`simplecache::https://...`) fsspec asks whether the file exists, which
    takes an HTTP 500 for no: the input pattern 'matched no files', the reader's record and a
    model file said the file was not there ('FileNotFoundError: URL', 'file not found'). A zip
    archive served with a 500 was 'FileNotFoundError' too. The chain's last part is asked why."""
    (served.root / "d.zip").write_bytes(_zip_of("a.txt", "".join(line + "\n" for line in LINES)))
    for url, name in [(f"{chain}{served.url}/ok/in.txt", "in.txt") for chain in ("simplecache::", "filecache::")] \
            + [(f"zip://a.txt::{served.url}/ok/d.zip", "d.zip")]:
        for status, why in ((500, "HTTP 500 Internal Server Error"), (403, "HTTP 403 Forbidden")):
            served.faults = {name: status}
            named = f"{url}: cannot be read ({why})"
            [record] = _read(url)
            assert record.reason == f"cannot read file: RemoteReadError: {named}", record.reason
            with pytest.raises(InputError) as caught:
                expand_patterns([url])
            assert str(caught.value) == f"cannot list input pattern {url!r}: {named}"
            with pytest.raises(OSError, match="RemoteReadError") as caught:
                read_sentences(url)
            assert named in str(caught.value)
            with pytest.raises(CheckpointError) as caught:
                read_bytes(url)
            assert str(caught.value) == named
        # a file not there is still said to be so
        served.faults = {name: 404}
        [record] = _read(url)
        assert record.reason.startswith("cannot read file: FileNotFoundError: "), record.reason
        with pytest.raises(CheckpointError, match="file not found$"):
            read_bytes(url)
        served.faults = {}  # and the chain reads the file (after the failures: a cache keeps it)
        assert _read(url) == LINES, url
    with pytest.raises(InputError, match="matches no files$"):
        expand_patterns([f"simplecache::{served.url}/ok/absent.txt"])


def test_a_server_error_for_a_chained_archive_is_named_where_its_file_system_is_made(served):
    """Making the file system of `zip://MEMBER::URL` reads the archive, and two checks made it just
    outside the translation of a server's failures: a member whose name says gzip (its empty-file
    check) read from an archive served with a 500 was 'FileNotFoundError: URL-of-the-archive' in
    its error record, and a look at a member's first bytes (`magic_compression`) raised that too."""
    text = "".join(line + "\n" for line in LINES)
    (served.root / "g.zip").write_bytes(_zip_of("a.txt.gz", text))
    (served.root / "d.zip").write_bytes(_zip_of("a.txt", text))
    gz, plain = f"zip://a.txt.gz::{served.url}/ok/g.zip", f"zip://a.txt::{served.url}/ok/d.zip"
    served.faults = {"g.zip": 500, "d.zip": 500}
    [record] = _read(gz)
    assert record.reason == f"cannot read file: RemoteReadError: {gz}: cannot be read (HTTP 500 Internal Server Error)"
    with pytest.raises(filesystems.RemoteReadError) as caught:
        magic_compression(plain)
    assert str(caught.value) == f"{plain}: cannot be read (HTTP 500 Internal Server Error)"
    served.faults = {"g.zip": 404, "d.zip": 404}  # an archive not there is still said to be so
    [record] = _read(gz)
    assert record.reason == f"cannot read file: FileNotFoundError: {served.url}/ok/g.zip"
    with pytest.raises(FileNotFoundError):
        magic_compression(plain)
    served.faults = {}
    assert magic_compression(plain) is None


def test_a_body_cut_short_under_a_block_cache_is_an_error_record(served, tmp_path, capsys):
    """Through `blockcache::`, fsspec's cache copied aiohttp's ClientPayloadError in as a block's
    bytes: "TypeError: a bytes-like object is required, not 'ClientPayloadError'" out of the
    reader (a failed worker, no error record) and out of embed-file (a traceback)."""
    url = f"blockcache::{served.url}/ok/in.txt"
    named = f"{url}: cannot be read (ClientPayloadError: Response payload is not completed"
    served.faults = {"in.txt": "cut-short"}
    [record] = _read(url)
    assert isinstance(record, ErrorRecord) and record.source == url
    assert record.reason.startswith(f"cannot read file: RemoteReadError: {named}"), record.reason
    with pytest.raises(OSError, match="RemoteReadError") as caught:
        read_sentences(url)
    assert named in str(caught.value)
    assert main(["embed-file", url, str(tmp_path / "out.hdf5")]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_our_own_type_error_while_reading_a_url_is_its_own(served):
    """Only the failure fsspec's cache copied is taken for the server's: a TypeError of ours in
    the block goes on as itself."""
    for url in (f"blockcache::{served.url}/ok/in.txt", f"{served.url}/ok/in.txt"):
        with pytest.raises(TypeError, match="can't concat str to bytes"):
            with filesystems.open_url(url) as f:
                f.read() + "ours"


@pytest.mark.parametrize("chain", ["simplecache::", "filecache::", "blockcache::"])
def test_a_cached_read_cut_short_is_downloaded_again_by_the_next_read(served, chain):
    """fsspec kept a download cut short in its cache (simplecache, filecache: half of the file's
    bytes) or the blocks it failed to fetch (blockcache: zeros), and the next read of the URL in the
    process (Beam's retry of the bundle) took them for the file: 21 of the 40 lines, or one line
    of NUL bytes, and no error. A failed read drops that file's copy, and no other file's."""
    (served.root / "other.txt").write_text("another file\n")
    other = f"{chain}{served.url}/ok/other.txt"
    url = f"{chain}{served.url}/ok/in.txt"
    assert _read(other) == ["another file"]
    served.faults = {"in.txt": "cut-short"}
    [record] = _read(url)
    assert "ClientPayloadError" in record.reason, record.reason
    served.faults = {}
    assert _read(url) == LINES
    assert read_sentences(url) == LINES
    # the other file is still read from the cache: the server no longer has it
    (served.root / "other.txt").unlink()
    assert _read(other) == ["another file"]


def test_a_cache_clean_up_that_fails_leaves_the_reads_own_failure(served, monkeypatch):
    """The clean-up after a failed read uses simplecache's private _check_file: should a later
    fsspec change it, its error must not take the place of the server's failure being reported."""
    from fsspec.implementations.cached import SimpleCacheFileSystem

    check_file = SimpleCacheFileSystem._check_file

    def changed(self, path):  # gone for the clean-up; the read itself uses it too
        # fsspec calls it through a lambda of its own
        if "_drop_cached_copy" in (sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name):
            raise AttributeError("_check_file is gone")
        return check_file(self, path)

    monkeypatch.setattr(SimpleCacheFileSystem, "_check_file", changed)
    url = f"simplecache::{served.url}/ok/in.txt"
    served.faults = {"in.txt": "cut-short"}
    with pytest.raises(OSError, match="RemoteReadError") as caught:
        read_sentences(url)
    assert "ClientPayloadError" in str(caught.value)


def test_an_input_urls_password_is_in_no_id_or_error_record_but_its_query_is(served, tmp_path):
    """Every doc_id ("<url>:<line>"), Document source and error record held the input URL as given:
    http://user:pw-7Hq@H/ok/in.txt?token=tok-9Zx wrote the password into every row. The user part is
    dropped; the query stays (it may be all that tells two inputs apart)."""
    (tmp_path / "www" / "bad.txt").write_bytes(b"fine\nbad \xff byte\n")
    scheme, _, host = served.url.partition("://")
    given, shown = f"{scheme}://user:pw-7Hq@{host}/ok/", f"{served.url}/ok/"
    records = list(read_work_item(WorkItem(given + "in.txt?token=tok-9Zx"), ReadOptions()))
    assert [(r.doc_id, r.source, r.text) for r in records] == [
        (f"{shown}in.txt?token=tok-9Zx:{n}", f"{shown}in.txt?token=tok-9Zx", text) for n, text in enumerate(LINES, 1)]
    [fine, bad] = read_work_item(WorkItem(given + "bad.txt"), ReadOptions())
    assert (fine.doc_id, fine.source) == (f"{shown}bad.txt:1", f"{shown}bad.txt")
    assert bad == ErrorRecord(f"{shown}bad.txt", 2, "invalid UTF-8 at byte 4: invalid start byte", "read",
                              f"{shown}bad.txt:2")
    served.faults = {"in.txt": 404}
    [missing] = read_work_item(WorkItem(given + "in.txt"), ReadOptions())
    assert missing == ErrorRecord(f"{shown}in.txt", None, f"cannot read file: FileNotFoundError: {shown}in.txt", "read")
