"""Reading documents from text, JSONL and Parquet files on any fsspec filesystem (no Beam here).

A reader takes one work item (`byte_ranges.py`): a whole file, or the lines that start inside a
byte range of one. Parquet files are read a batch of rows at a time.

Line ends: b"\\n" ends a line and a "\\r" before it is dropped (CRLF). A lone "\\r" is not a line
end: cutting on it too would need a look-ahead byte at every range edge, and classic-Mac files
are rare. It stays in the text, where spaCy treats it as whitespace.

What becomes an `ErrorRecord` (stage "read") rather than a `Document`: invalid UTF-8, malformed
JSON, JSON nested too deeply for the parser or holding an integer of more than 4300 digits, a JSON
value that is not an object, a missing or non-string text, an id that is not a
string or an integer, a timestamp that is not ISO 8601 or whose UTC form lies outside Python's
datetime range (pyarrow would write it, no reader could convert it back), a missing or null
timestamp when `timestamp_required`, a line (a file read whole, a Parquet text value) of more
than `max_document_mb` (never held whole: read past in chunks), text containing NUL characters (in
practice they mean a binary or UTF-16 file read as UTF-8, whose "text" would be garbage), text or
an id with a lone surrogate (a JSON escape such as "\\ud800" without its pair: no UTF-8 file
can hold it), an id with a NUL character, a JSON record that gives a field it reads (text, id,
timestamp) more than once, a Parquet string value that is not valid UTF-8, a Parquet timestamp or
date that Python's datetime cannot hold (or with an unknown time zone), a Parquet file without a
named column, with several columns of that name or with a column of the wrong type (one record
for the file, line None), and a file that
cannot be opened or decompressed (line None when nothing could be read, else the line at which
reading failed; documents read before the failure are kept), a zip archive holding other than
exactly one file included, and a Parquet row group that cannot be read (the line of its first row
not read; the file's other groups are still read). An ErrorRecord carries the record's document id where it is known
(the id field once it parsed, else "<url>:<line>"), so that it can be matched with the source.
Dictionary-encoded Parquet columns (pandas categoricals) are read decoded.
"""

from __future__ import annotations

import codecs
import datetime
import errno
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from elmo_pipeline.corpus.byte_ranges import WorkItem
from elmo_pipeline.corpus.input_files import READ_CHUNK_BYTES, READ_ERRORS, InputError, magic_compression, open_input
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.records import Document, ErrorRecord, doc_id_problem, has_lone_surrogate
from elmo_pipeline.corpus.schema import open_parquet, parse_timestamp
from elmo_pipeline.filesystems import (SPECIAL_FILE, failure_text, local_special_file, open_url,
                                       refuse_special_under_chain, remote_failures_named, url_to_fs,
                                       without_userinfo)

Records = Iterator[Document | ErrorRecord]



@dataclass
class ReadStats:
    """Filled in by `read_work_item` while it runs."""

    # bytes consumed: the (decompressed) bytes of the lines or file for text and JSONL, the
    # in-memory Arrow size of the columns read for Parquet
    bytes_read: int = 0


# --- reading -----------------------------------------------------------------------------------


def read_documents(urls: Iterable[str], options: ReadOptions, stats: ReadStats | None = None) -> Records:
    """Every document of `urls`, each file read whole by one reader (the reference the splits match)."""
    for url in urls:
        yield from read_work_item(WorkItem(url), options, stats)


def read_work_item(item: WorkItem, options: ReadOptions, stats: ReadStats | None = None) -> Records:
    """The documents, and error records, of one work item.

    Text format, a document per line: empty lines are skipped (they are not documents, but they
    count for line numbers); a whitespace-only line is a document (that has no tokens). JSONL:
    blank lines are skipped too. A document per file: an empty file gives no document.
    """
    stats = stats if stats is not None else ReadStats()
    if options.input_format == "parquet":
        return _read_parquet(item.url, options, stats)
    if options.doc_per == "file":
        return _read_whole_file(item.url, options, stats)
    return _read_lines(item, options, stats)


def read_text_lines(url: str, max_document_mb: float | None = None) -> Iterator[tuple[int, str | ErrorRecord]]:
    """Every line of the text file `url` as the text format reads it (line ends, CRLF, a BOM,
    decompression): (1-based line number, its text, "" for an empty line), or the line's
    ErrorRecord (invalid UTF-8, NUL, more than `max_document_mb`) in place of its text. A file
    that cannot be read or decompressed raises an OSError naming it and why ("cannot read F:
    zlib.error: ..."), a missing one "F: no such file"; a glob that matches no file an InputError,
    and a local device or FIFO a ValueError, unread. For commands that take a file of lines whole (`embed-file`, `similarity
    --file`, the labelled files of `probe`). `max_document_mb` is the command's --max-document-mb,
    named in the reason; None: extract's default bound, for a command without that flag."""
    options = ReadOptions() if max_document_mb is None else ReadOptions(max_document_mb=max_document_mb)
    refuse_special_under_chain(url)  # before the chain's file system opens it
    try:
        with remote_failures_named(url):  # a chain's file system opens its archive: an HTTP 500 was "not found"
            fs, path = url_to_fs(url)
        if local_special_file(fs, path):  # /dev/zero has no line end: its first line would fill memory
            raise ValueError(f"{url}: {SPECIAL_FILE}")
        if set("*?[") & set(path) and not fs.exists(path):  # fsspec's own error was four lines of advice on globs
            # no OSError: "cannot read P: FileNotFoundError: P: ..." would name the pattern twice
            raise InputError(f"{url}: no such file (one file is read, not a glob)")
        # bounded as extract's lines are: a .gz of 3 MB that expands to one line of 3 GiB was held whole
        for line, raw in bounded_lines(url, options.max_document_bytes):
            if raw is None:
                yield line, _bad(url, line, options.too_large("line", named=max_document_mb is not None),
                                 _known_id(url, line, None, options))
                continue
            record = _parse_text(url, line, raw, options)
            yield line, "" if record is None else record.text if isinstance(record, Document) else record
    except READ_ERRORS as e:
        if isinstance(e, FileNotFoundError) and _names_only_the_file(url, e):
            # "cannot read F: FileNotFoundError: [Errno 2] No such file or directory: 'F'" named it twice
            raise FileNotFoundError(f"{url}: no such file") from None
        raise OSError(f"cannot read {url}: {failure_text(e)}") from e


def _names_only_the_file(url: str, error: FileNotFoundError) -> bool:
    """Whether `error` says no more than that a file is missing: the OS's, naming its path, or
    fsspec's, the path alone; not a reason of its own (a name holding '::')."""
    said = str(error)
    return error.strerror == os.strerror(errno.ENOENT) or (bool(said) and url.endswith(said))


def bounded_lines(url: str, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(1-based number, bytes without the line end or a leading BOM) of each line of the whole file
    `url`, decompressed as every reader does; None for a line of more than `max_bytes`, which is
    read past, never held whole. Read errors are raised (READ_ERRORS), for the caller to name."""
    return _iter_lines(WorkItem(url), ReadStats(), max_bytes)


def _bad(url: str, line: int | None, reason: str, doc_id: str | None = None) -> ErrorRecord:
    shown = without_userinfo(url)
    if shown != url:  # a failed read's reason may quote the URL ("FileNotFoundError: URL")
        reason = reason.replace(url, shown)
    return ErrorRecord(shown, line, reason, "read", doc_id)


def _read_error(url: str, line: int | None, error: BaseException) -> ErrorRecord:
    return _bad(url, line, f"cannot read file: {failure_text(error)}")


def _read_whole_file(url: str, options: ReadOptions, stats: ReadStats) -> Records:
    try:
        with open_input(url) as f:
            data = _read_at_most(f, options.max_document_bytes + 1)  # one byte more tells a file past the bound
    except READ_ERRORS as e:
        yield _read_error(url, None, e)
        return
    stats.bytes_read += len(data)
    if len(data) > options.max_document_bytes:
        del data
        yield _bad(url, 1, options.too_large("file"), _known_id(url, 1, None, options))
        return
    if data.startswith(codecs.BOM_UTF8):
        del data[:len(codecs.BOM_UTF8)]  # in place: removeprefix would copy the file
    # the text is kept verbatim (CRLF included): token offsets then point into the file's text
    text = _decode(url, 1, data, options)
    # the bytes must not live on beside the text while the document is processed downstream,
    # which happens while this generator waits at its `yield`
    del data
    if isinstance(text, ErrorRecord):
        yield text
    elif text:
        yield _document(url, 1, text, None, None, options)


def _read_at_most(f: BinaryIO, limit: int) -> bytearray:
    """The first `limit` bytes of `f` (fewer at its end), read in chunks: one read of `limit`
    bytes allocates them all first (a MemoryError for a bound of 1 TiB, whatever the file)."""
    data = bytearray()
    while len(data) < limit:
        chunk = f.read(min(limit - len(data), READ_CHUNK_BYTES))
        if not chunk:
            break
        data += chunk
    return data


def _read_lines(item: WorkItem, options: ReadOptions, stats: ReadStats) -> Records:
    parse = _parse_jsonl if options.input_format == "jsonl" else _parse_text
    next_line = None  # the line being read when a read error happens; None before the first
    try:
        for line, raw in _iter_lines(item, stats, options.max_document_bytes):
            next_line = line + 1
            if raw is None:
                yield _bad(item.url, line, options.too_large("line"), _known_id(item.url, line, None, options))
                continue
            record = parse(item.url, line, raw, options)
            del raw  # a long line's bytes must not live on while its document is processed
            if record is not None:
                yield record
    except READ_ERRORS as e:
        yield _read_error(item.url, next_line, e)


def _iter_lines(item: WorkItem, stats: ReadStats, max_bytes: int | None) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes without the line end) of each line starting in the item's range; None in
    place of the bytes of a line longer than `max_bytes` (None: no bound), which is never held whole.

    A generator suspended at `yield` keeps its locals, and the consumer yields the line's document
    downstream before asking for the next line: the lines come from `_Lines`, whose `__next__`
    returns a line without keeping it, and `yield from` binds none, so a 10 MB line is not held
    twice more while its document is processed."""
    with open_input(item.url, sniff=item.whole, end=item.end) as f:
        position, line = item.start, item.lines_before + 1
        if item.start > 0:
            # Look from one byte early: if that byte is the newline, our first line starts exactly
            # at `start`; otherwise the partial line's newline lies inside our range, so it was not
            # counted in lines_before and the first full line is one further.
            f.seek(item.start - 1)
            position, found = _past_newline(f, item.start - 1, item.end)
            if not found:  # no line starts in the range
                return
            if position > item.start:
                line += 1
        yield from _Lines(f, position, line, item.end, stats, max_bytes)


# bytes read at a time while looking for the end of a line that started in an earlier range
_SKIP_BYTES = 64 * 2**10


def _past_newline(f: BinaryIO, position: int, end: int | None) -> tuple[int, bool]:
    """(the offset just past the first newline at or after `position`, where `f` stands, True), and
    `f` left there; (the offset reached, False) when there is none before `end` or the end of the
    file. The line that holds `position` is not read whole: a line longer than a range was read
    by every range it crosses, each to its end (a 1 GB line in 64 MiB ranges: 8 GB read, and up to
    1 GB held by each of 16 readers). Read by lines, not read and sought back: a read that emptied
    an object store's buffer (`input_files._Fetches`) fetched those bytes again."""
    while end is None or position < end:
        chunk = f.readline(_SKIP_BYTES)
        if not chunk:
            return position, False
        position += len(chunk)
        if chunk.endswith(b"\n"):
            return position, True
    return position, False


class _Lines:
    """The lines of an open file from byte `position` (line number `line`) up to the first that
    starts at or after `end`; a line of more than `max_bytes` (line end left out) is None, read
    past in chunks to its end, wherever its range ends, as a range reads its last line whole."""

    def __init__(self, f: BinaryIO, position: int, line: int, end: int | None, stats: ReadStats,
                 max_bytes: int | None) -> None:
        self._f, self._position, self._line, self._end, self._stats = f, position, line, end, stats
        self._max_bytes = sys.maxsize if max_bytes is None else max_bytes
        # the line end's two bytes at most (CRLF) are read beyond the bound: a line of exactly
        # `max_bytes` is read
        self._limit = -1 if max_bytes is None else max_bytes + 2

    def __iter__(self) -> "_Lines":
        return self

    def __next__(self) -> tuple[int, bytes | None]:
        if self._end is not None and self._position >= self._end:
            raise StopIteration
        raw = self._f.readline(self._limit)
        if not raw:
            raise StopIteration
        self._position += len(raw)
        self._stats.bytes_read += len(raw)
        line, self._line = self._line, self._line + 1
        # a line read in at most the bound's bytes is within it, line end or not: the one test
        # nearly every line needs (working out its line end's size slowed reading WikiText-2 by 12%)
        if len(raw) > self._max_bytes:
            ended = raw.endswith(b"\n")
            if not ended or len(raw) - (2 if raw.endswith(b"\r\n") else 1) > self._max_bytes:
                del raw  # past the bound: dropped before the rest of the line is read past
                if not ended:
                    start = self._position
                    self._position, _ = _past_newline(self._f, self._position, None)
                    self._stats.bytes_read += self._position - start
                return line, None
        return line, _strip_line_end(raw)


def _strip_line_end(raw: bytes) -> bytes:
    if raw.endswith(b"\n"):
        raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    # A BOM is dropped at the start of any line, not only the file's first: files joined by `cat`
    # (or the members of a multi-member gzip) carry each file's BOM there, where it would be
    # glued to the first token of a text line and make a JSONL record malformed.
    return raw.removeprefix(codecs.BOM_UTF8)


# UTF-32's marks first: UTF-32LE's starts with UTF-16LE's
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
              (codecs.BOM_UTF16_BE, "UTF-16"))


def undecodable_reason(raw: bytes, error: UnicodeDecodeError) -> str:
    """Why `raw` is not UTF-8: the UTF-16 or UTF-32 byte-order mark it starts with (what Windows'
    editors save as "Unicode", where "invalid start byte" alone left the user guessing), else the
    decoder's reason."""
    return next((f"a {name} byte-order mark (the file is {name}: convert it to UTF-8)"
                 for bom, name in _WIDE_BOMS if raw.startswith(bom) and error.start < len(bom)), error.reason)


def _decode(url: str, line: int, raw: bytes, options: ReadOptions) -> str | ErrorRecord:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _bad(url, line, f"invalid UTF-8 at byte {e.start}: {undecodable_reason(raw, e)}",
                    _known_id(url, line, None, options))


def _parse_text(url: str, line: int, raw: bytes, options: ReadOptions) -> Document | ErrorRecord | None:
    if not raw:
        return None
    text = _decode(url, line, raw, options)
    return text if isinstance(text, ErrorRecord) else _document(url, line, text, None, None, options)


def _parse_jsonl(url: str, line: int, raw: bytes, options: ReadOptions) -> Document | ErrorRecord | None:
    text = _decode(url, line, raw, options)
    if isinstance(text, ErrorRecord):
        return text
    if not text.strip(" \t\r\n"):  # JSON's whitespace only: a line of U+00A0 is a malformed record
        return None
    unparsed_id = _known_id(url, line, None, options)  # before the id field could be read
    try:
        value = json.loads(text, object_pairs_hook=_JsonObject.of)
    except json.JSONDecodeError as e:
        # some of json's messages end in " at" ("Unterminated string starting at"): one "at" is said here
        reason = f"malformed JSON: {e.msg.removesuffix(' at')} at column {e.colno}"
        before = text[:e.pos]
        # the blanks between the first value and the extra data: a CR there, not one inside the
        # first record, parts records (a whole file of records as one line said no more)
        if e.msg == "Extra data" and "\r" in before[len(before.rstrip(" \t\r")):]:
            reason += " (a lone CR before it: records parted by CR alone? only \\n ends a line)"
        return _bad(url, line, reason, unparsed_id)
    except RecursionError:  # the C parser's guard against exhausting the stack
        return _bad(url, line, "JSON nested too deeply to parse", unparsed_id)
    except ValueError as e:  # well-formed but unparseable, e.g. an integer of more than 4300 digits
        return _bad(url, line, f"JSON cannot be parsed: {e}", unparsed_id)
    if not isinstance(value, dict):
        return _bad(url, line, f"JSON value is {_kind(value)}, not an object", unparsed_id)
    doc_id = value.get(options.id_field) if options.id_field is not None else None
    known_id = unparsed_id if options.id_field in value.repeated else _known_id(url, line, doc_id, options)
    for name in (options.text_field, options.id_field, options.timestamp_field):
        if name is not None and name in value.repeated:
            return _bad(url, line, f"field {name!r} appears {value.repeated[name]} times in the record; which value is "
                        "meant is unknown", known_id)
    required = (("text", options.text_field), ("id", options.id_field),
                ("timestamp", options.timestamp_field if options.timestamp_required else None))
    for kind, name in required:
        if name is not None and name not in value:
            return _bad(url, line, f"missing {kind} field {name!r}", _known_id(url, line, doc_id, options))
    timestamp = value.get(options.timestamp_field) if options.timestamp_field is not None else None
    return _document(url, line, value[options.text_field], doc_id, timestamp, options)


class _JsonObject(dict):
    """A JSON object that counts the keys it was given more than once (json keeps the last value)."""

    __slots__ = ("repeated",)

    @classmethod
    def of(cls, pairs: list[tuple[str, object]]) -> "_JsonObject":
        obj = cls(pairs)
        obj.repeated = {}
        if len(obj) != len(pairs):
            for key, _ in pairs:
                obj.repeated[key] = obj.repeated.get(key, 0) + 1
            obj.repeated = {key: n for key, n in obj.repeated.items() if n > 1}
        return obj


def _id_problem(doc_id: object, options: ReadOptions) -> str | None:
    """Why the id field's value cannot be a document id; None when it can (or there is no id field)."""
    if options.id_field is None:
        return None
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):  # None included
        return f"id field {options.id_field!r} is {_kind(doc_id)}, not a string or int"
    problem = doc_id_problem(doc_id) if isinstance(doc_id, str) else None
    return f"id field {options.id_field!r} {problem}" if problem else None


def _known_id(url: str, line: int, doc_id: object, options: ReadOptions) -> str | None:
    """The id a record's document has (or would have had): the id field's value when it is a valid
    one, "<url>:<line>" without an id field; None when the id field is missing or bad. It goes into
    the record's ErrorRecord, so a rejected record can be matched with its source's own ids."""
    if options.id_field is None:
        return f"{without_userinfo(url)}:{line}"  # a password in the URL is not written into every row
    return None if _id_problem(doc_id, options) else str(doc_id)


def _document(
    url: str, line: int, text: object, doc_id: object, timestamp: object, options: ReadOptions,
) -> Document | ErrorRecord:
    """A Document once the values of a record are checked, else the reason as an ErrorRecord."""
    known_id = _known_id(url, line, doc_id, options)
    if not isinstance(text, str):
        return _bad(url, line, f"text field {options.text_field!r} is {_kind(text)}, not a string", known_id)
    if "\x00" in text:
        return _bad(url, line, "text contains NUL characters (a binary or UTF-16 file?)", known_id)
    if has_lone_surrogate(text):
        return _bad(url, line, f"text field {options.text_field!r} holds a lone surrogate, which UTF-8 cannot encode",
                    known_id)
    id_problem = _id_problem(doc_id, options)
    if id_problem:
        return _bad(url, line, id_problem)
    if timestamp is not None or options.timestamp_required:
        problem = timestamp_problem(timestamp)
        if problem:
            return _bad(url, line, f"timestamp field {options.timestamp_field!r} {problem}", known_id)
        timestamp = _iso_form(timestamp)
    return Document(known_id, text, without_userinfo(url), line, timestamp)


def _kind(value: object) -> str:
    if isinstance(value, _JsonObject):
        return "dict"
    return "null" if value is None else type(value).__name__


def _iso_form(value: object) -> str:
    """A timestamp value as ISO 8601 text: Parquet timestamp and date columns give datetimes."""
    return value.isoformat() if isinstance(value, (datetime.datetime, datetime.date)) else value


def timestamp_problem(value: object) -> str | None:
    """Why a timestamp value cannot be an event time; None when it can. Its UTC form, which the
    event_timestamp column stores, must lie in Python's datetime range (years 1 to 9999):
    "9999-12-31T23:00:00-05:00" is valid ISO 8601, but pyarrow would write year 10000, which
    no reader converts back to a datetime."""
    if value is None:
        return "is null, not an ISO 8601 time"
    if not isinstance(value, (str, datetime.datetime, datetime.date)):
        return "is not ISO 8601"
    try:
        parsed = parse_timestamp(_iso_form(value))
    except ValueError:
        return "is not ISO 8601"
    try:
        parsed.astimezone(datetime.timezone.utc)
    except OverflowError:
        return "is outside Python's datetime range (years 1 to 9999) in UTC"
    return None


# --- Parquet -----------------------------------------------------------------------------------


# Rows of a Parquet file decoded and converted to Python at a time. A whole row group was: pandas
# and pyarrow write up to a million rows in one, and 260 MB of text in one group took 940 MiB.
PARQUET_BATCH_ROWS = 1024


def _read_parquet(url: str, options: ReadOptions, stats: ReadStats) -> Records:
    """Rows as documents, PARQUET_BATCH_ROWS in memory at a time; `line` is the 1-based row number."""
    named = (options.text_field, options.id_field, options.timestamp_field)
    columns = list(dict.fromkeys(name for name in named if name is not None))
    try:
        with open_url(url) as f:
            parquet = open_parquet(f)
            problem = _parquet_schema_problem(parquet.schema_arrow, options)
            if problem:
                yield _bad(url, None, problem)
                return
            first = 1
            for group in range(parquet.num_row_groups):
                yield from _row_group_documents(url, parquet, group, first, columns, options, stats)
                first += parquet.metadata.row_group(group).num_rows
    except READ_ERRORS as e:  # the file or its footer: no row could be read
        compressed = _compression_seen(url)
        if compressed is not None:  # Arrow says "Parquet magic bytes not found": a corrupt file, it seems
            yield _bad(url, None, f"cannot read file: it is {compressed}-compressed, not Parquet (which compresses "
                       "inside the file); decompress it")
        else:
            yield _read_error(url, None, e)


def _row_group_documents(
    url: str, parquet: pq.ParquetFile, group: int, first: int, columns: list[str], options: ReadOptions,
    stats: ReadStats,
) -> Records:
    """The rows of one row group, numbered from `first`. Read a group at a time because groups are
    independent: a damaged page costs its own group's rows, one record naming them, and the rows
    of the file's other groups are read (batches that crossed groups lost the good rows before it).
    """
    row = first
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=columns,
                                          use_threads=False):
            stats.bytes_read += sum(column.nbytes for column in batch.columns)
            values = {name: _column_values(batch.column(name)) for name in columns}
            for i in range(batch.num_rows):
                yield _parquet_document(url, row, values, i, options)
                row += 1
    except READ_ERRORS as e:  # Arrow's message runs over lines (thrift's): one line, all of it
        last = first + parquet.metadata.row_group(group).num_rows - 1
        yield _bad(url, row, f"cannot read file: row group {group} (rows {row}-{last} not read): "
                   f"{' '.join(failure_text(e).split())}")


def _compression_seen(url: str) -> str | None:
    """The compression that the first bytes of `url` show; None for none, or a file that cannot be read."""
    try:
        return magic_compression(url)
    except READ_ERRORS:
        return None


class _BadValue(NamedTuple):
    """A Parquet value that has no Python form: a string that is not valid UTF-8 (Parquet writers
    do not all check), a timestamp or date outside Python's datetime range, an unknown time zone."""

    reason: str


# What converting one Parquet value to Python raises (UnicodeDecodeError is a ValueError;
# OverflowError for a datetime out of range; LookupError for an unknown time zone).
_VALUE_ERRORS = (ValueError, OverflowError, LookupError)


def _column_values(column: pa.Array) -> list:
    try:
        return column.to_pylist()
    except _VALUE_ERRORS:  # some value cannot be converted: convert one by one, marking the bad ones
        return [_scalar_value(scalar) for scalar in column]


def _scalar_value(scalar: pa.Scalar) -> object:
    try:
        return scalar.as_py()
    except UnicodeDecodeError as e:
        return _BadValue(f"invalid UTF-8 at byte {e.start}: {e.reason}")
    except _VALUE_ERRORS as e:
        return _BadValue(f"{scalar.type} value cannot be converted ({type(e).__name__}: {e})")


def _parquet_document(
    url: str, row: int, values: dict[str, list], i: int, options: ReadOptions,
) -> Document | ErrorRecord:
    doc_id = values[options.id_field][i] if options.id_field is not None else None
    for name, column in values.items():
        if isinstance(column[i], _BadValue):
            return _bad(url, row, f"column {name!r}: {column[i].reason}", _known_id(url, row, doc_id, options))
    text = values[options.text_field][i]
    if isinstance(text, str) and _utf8_size_over(text, options.max_document_bytes):  # a line's bound, for a row
        return _bad(url, row, f"column {options.text_field!r}: " + options.too_large("text"),
                    _known_id(url, row, doc_id, options))
    timestamp = values[options.timestamp_field][i] if options.timestamp_field is not None else None
    return _document(url, row, text, doc_id, timestamp, options)


def _utf8_size_over(text: str, limit: int) -> bool:
    """Whether `text` takes more than `limit` bytes as UTF-8, encoding it only where its length
    in code points (1 to 4 bytes each) leaves it in doubt."""
    if len(text) > limit or 4 * len(text) <= limit:
        return len(text) > limit
    return len(text.encode("utf-8", "surrogatepass")) > limit


def _parquet_schema_problem(schema: pa.Schema, options: ReadOptions) -> str | None:
    """Why the file cannot give documents (a missing or mistyped column), checked once per file."""
    checks = [(options.text_field, "text", _is_string)]
    if options.id_field is not None:
        checks.append((options.id_field, "id", lambda t: _is_string(t) or pa.types.is_integer(t)))
    if options.timestamp_field is not None:
        checks.append((options.timestamp_field, "timestamp",
                       lambda t: _is_string(t) or pa.types.is_timestamp(t) or pa.types.is_date(t)))
    for name, role, accepts in checks:
        if name not in schema.names:
            return f"Parquet file has no {role} column {name!r} (columns: {', '.join(schema.names)})"
        if schema.names.count(name) > 1:
            return f"Parquet file has {schema.names.count(name)} columns named {name!r}: which is the {role} is unknown"
        arrow_type = schema.field(name).type
        if pa.types.is_dictionary(arrow_type):  # pandas categoricals and many writers: read back decoded
            arrow_type = arrow_type.value_type
        if not accepts(arrow_type):
            return f"Parquet {role} column {name!r} has type {schema.field(name).type}"
    return None


def _is_string(arrow_type: pa.DataType) -> bool:
    string_kinds = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    return any(is_kind(arrow_type) for is_kind in string_kinds)
