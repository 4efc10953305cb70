"""The main job: read -> tokenize with spaCy -> embed with the biLM -> mix -> Parquet.

    python -m elmo_pipeline.pipelines.extract --input 'gs://bucket/corpus/*.txt.gz' --output gs://bucket/features \
        [--runner DataflowRunner ...any Beam option]

Without `--runner` the job runs locally on Beam's FnApiRunner, which downloads nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import apache_beam as beam
import fsspec
import pyarrow.parquet as pq
import spacy
import torch

import elmo_pipeline
from elmo_pipeline.commands import job_main
from elmo_pipeline.filesystems import written_for
from elmo_pipeline.formats.atomic import check_output_folder, write_url_atomically
from elmo_pipeline.formats.files import join_url, model_shown, read_bytes
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.layers_digest import layers_sha256
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.embedding.batch import build_mixes
from elmo_pipeline.embedding.options import add_extract_args
from elmo_pipeline.pipelines.beam_options import check_beam_args, worker_layout, workers_run_here
from elmo_pipeline.pipelines.earlier_run import ASIDE_PREFIX
from elmo_pipeline.pipelines.paths import check_beam_writable, make_paths_absolute, output_claimed
from elmo_pipeline.pipelines.runner import run_pipeline
from elmo_pipeline.corpus.input_files import check_inputs_outside, expand_patterns
from elmo_pipeline.corpus.options import check_input_args
from elmo_pipeline.runtime import PlannedRuntime, check_precision, plan_runtime
from elmo_pipeline.model.scalar_mix import PRESETS, MixSpec, load_mix_specs
from elmo_pipeline.corpus.schema import PARQUET_SHARD, OutputSpec, check_mix_names, layer_meanings
from elmo_pipeline.corpus.tokenization import check_nlp, describe_segmenter, planned_segmenter
from elmo_pipeline.transforms.embed import EmbedSentences
from elmo_pipeline.transforms import metrics as m
from elmo_pipeline.transforms.mix import MixLayers
from elmo_pipeline.transforms.read import FindDuplicateIds, ReadDocuments
from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy
from elmo_pipeline.transforms.write import ERRORS_SHARD, SHARD_FILE, TEMP_FOLDER, WriteErrors, WriteParquet

SUMMARY_FILE = "summary.json"
# what a run writes beside its shards: the summary, and the summary being written when it was killed
_RUN_FILES = (SUMMARY_FILE, SUMMARY_FILE + ".partial")  # the second: what a killed run of an earlier version left
MIX_FILE_BYTES = 1 << 20  # probe's mix.json is under 1 KB per mix


def split_mixes(items: Sequence[str]) -> list[tuple[str, str]]:
    """(NAME, SOURCE) of each `NAME=SOURCE`; a malformed item, or names that would share a column
    (`check_mix_names`, alike but for case included), are refused naming --mix: a check that
    needs no model, so that `prepare_job` makes it before the model loads."""
    pairs = []
    for item in items:
        name, sep, source = item.partition("=")
        if not sep or not source:
            raise ValueError(f"--mix {item!r}: expected NAME=SOURCE")
        pairs.append((name, source))
    check_mix_names([name for name, _ in pairs], "--mix")
    return pairs


def parse_mixes(items: Sequence[str], n_layers: int, layers: str | None = None) -> dict[str, MixSpec]:
    """`NAME=average|top|FILE`; from a file holding several mixes, the one called NAME is taken.
    A mix that records the layers it was learned on (`probe` writes their `layers_sha256`) must
    have been learned on the job's model, whose layers have the digest `layers`."""
    specs: dict[str, MixSpec] = {}
    for item, (name, source) in zip(items, split_mixes(items)):
        if source in PRESETS:
            specs[name] = MixSpec.preset(source, n_layers)
            continue
        try:  # bounded: a mix file holds a few numbers per mix, and /dev/zero would fill memory
            data = read_bytes(source, MIX_FILE_BYTES, "a mix file")
        except (ValueError, OSError) as exc:
            raise ValueError(f"--mix {item!r}: {exc}") from None
        found = load_mix_specs(data, source)
        if len(found) == 1:
            specs[name] = next(iter(found.values()))
        elif name in found:
            specs[name] = found[name]
        else:
            raise ValueError(f"--mix {item!r}: {source} holds {sorted(found)}, not {name!r}")
        learned_on = specs[name].layers_sha256
        if learned_on is not None and layers is not None and learned_on != layers:
            raise ValueError(f"--mix {item!r}: the mix was learned on the layers of another model (its "
                             f"layers_sha256 {learned_on[:12]}; this job's model's {layers[:12]}): give --model "
                             "the model it was learned with (probe's report.json names it), or remove layers_sha256 "
                             "from the file to apply it to this model's layers anyway")
        try:  # what a file may hold that no mix of this model can (1e300, a weight per layer of another model)
            build_mixes({name: specs[name]}, n_layers)
        except ValueError as exc:
            raise ValueError(f"--mix {item!r}: {exc}") from None
    return specs


@dataclass
class ExtractJob:
    """Everything decided before the pipeline starts: failures here come before any data is read."""

    args: argparse.Namespace
    spec: OutputSpec
    mixes: dict[str, MixSpec]
    started: str
    segmenter: str | None = None  # a blank Chinese pipeline's, chosen here for every worker
    planned: PlannedRuntime | None = None  # what the metadata says the workers embed with
    earlier: tuple[str, ...] = ()  # an earlier run's entries in the output folder, replaced (--overwrite)


def prepare_job(args: argparse.Namespace, beam_args: Sequence[str] = ()) -> ExtractJob:
    """Checks the options, model and mixes, and writes down what the output will say produced it.

    The metadata's `runtime` (device type, LSTM kernel, precision) is what the workers will use
    as far as this process can know: the device when `--device` names one or the workers run on
    this machine (`beam_args` name no remote runner), the kernel when it is the same on every
    device they could have; null where only each worker knows, and then summary.json's
    `tokens_embedded_on` says what they used. A worker that would differ from the metadata fails
    its batch. The versions are this process's; a blank Chinese pipeline's segmenter (jieba or
    single characters) is chosen here and every worker uses it.

    Everything a worker would otherwise find wrong is checked here, before `--overwrite` clears
    the output folder: the options that go together (the numbers were checked as they were
    parsed), the spaCy language or pipeline, the model and the mixes."""
    check_input_args(args)
    split_mixes(args.mix)  # parse_mixes reads the files once the model is loaded; their names are checked now
    if args.layers == "none" and not args.mix:  # the model would run for files without a vector
        raise ValueError("--layers none writes no layer, so it needs at least one --mix")
    if args.event_time == "field" and not args.timestamp_field:
        raise ValueError("--event-time field needs --timestamp-field (and --format jsonl or parquet)")
    if args.timestamp_field and args.event_time != "field":  # read, it would only turn records into errors
        raise ValueError(f"--timestamp-field is read for --event-time field only; with --event-time "
                         f"{args.event_time} no column holds it: add --event-time field, or leave it out")
    inputs = expand_patterns(args.input)  # a glob matching nothing fails first: before the model loads or --overwrite clears
    segmenter = planned_segmenter(args.lang, args.spacy_model)
    nlp = check_nlp(args.lang, args.spacy_model, segmenter)
    # validates the files and the kernel for them (fused and clips); workers load their own copy
    model = BiLM.load(args.model, cache_size=0, kernel=args.kernel)
    n_layers, width = model.config.n_output_layers, model.config.output_dim
    digest = layers_sha256(model)
    mixes = parse_mixes(args.mix, n_layers, digest)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    planned = plan_runtime(model, args.device, args.kernel, workers_run_here(beam_args))
    if planned.device is not None:  # fp16 on CPU fails here, not on a worker; slow bf16 warns here too
        check_precision(torch.device(planned.device), args.precision)
    metadata = {
        "package_version": elmo_pipeline.__version__,
        "versions": {"elmo_pipeline": elmo_pipeline.__version__, "spacy": spacy.__version__,
                     "torch": torch.__version__, "apache_beam": beam.__version__},
        "runtime": {"device": planned.device, "kernel": planned.kernel, "precision": args.precision},
        "model": {"location": model_shown(args.model), "name": model.config.name,
                  "sha256": model.checksum, "layers_sha256": digest, "config": model.config.to_dict()},
        "mixes": {name: spec.to_dict() for name, spec in mixes.items()},
        "tokenizer": {"library": "spacy", "lang": nlp.lang, "model": args.spacy_model,
                      "max_sentence_tokens": args.max_sentence_tokens, **describe_segmenter(segmenter)},
        "layers": layer_meanings(n_layers),
        "dtype": args.dtype,
        "started": started,
    }
    spec = OutputSpec(n_layers=n_layers, width=width, layout=args.layout, layers=args.layers, dtype=args.dtype,
                      mix_names=tuple(mixes), with_timestamp=args.event_time != "none", metadata=metadata)
    earlier = _check_output(args.output, args.overwrite, inputs)
    return ExtractJob(args, spec, mixes, started, segmenter, planned, tuple(earlier))


def _check_output(output: str, overwrite: bool, inputs: Sequence[str]) -> list[str]:
    """Stale shards of an earlier run would be read as part of this one: refuse, or give them to
    be replaced (unless they are among the `inputs`)."""
    check_beam_writable(output)  # the Parquet and error sinks are Beam's
    check_output_folder(output)
    fs, root = fsspec.core.url_to_fs(output)
    if not fs.exists(root):
        return []
    ours = [entry["name"] for entry in fs.ls(root, detail=True) if _is_run_output(entry)]
    check_inputs_outside(inputs, ours, output)
    if ours and not overwrite:
        raise ValueError(f"{output} already holds output of an earlier run ({len(ours)} files{_set_aside(ours)}); "
                         "use --overwrite")
    return ours


def _set_aside(entries: Sequence[str]) -> str:
    """What the refusal should say of a run a killed `--overwrite` run left set aside: it is whole,
    and --overwrite deletes it with the rest."""
    aside = [name for name in map(base_name, entries) if name.startswith(ASIDE_PREFIX)]
    if not aside:
        return ""
    return (f"; {', '.join(aside)} holds the run before a run that was killed part way, whole: move its files back "
            "to keep it, as --overwrite deletes it too")


def _is_run_output(entry: dict[str, Any]) -> bool:
    """Whether a folder entry is one that a run writes, by its exact name: the shards, the summary,
    and the sinks' temporary folders (what a failed run left: files are renamed into place only
    at the end). Anything else in the folder (notes, a my_summary.json) is the user's and stays."""
    name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
    if entry["type"] == "directory":  # a run killed outright leaves the one before it set aside
        return TEMP_FOLDER.fullmatch(name) is not None or name.startswith(ASIDE_PREFIX)
    return _is_run_file(name)


def _is_run_file(name: str) -> bool:
    return (SHARD_FILE.fullmatch(name) is not None or name in _RUN_FILES
            or written_for(name) == SUMMARY_FILE)


def _with_event_time(job: ExtractJob):
    def stamp(sentence):
        return sentence._replace(timestamp=job.started)
    return stamp


def build(p: beam.Pipeline, job: ExtractJob) -> int:
    """Adds the job's stages to `p`; returns the number of input files they read."""
    a = job.args
    layout = worker_layout(p.options)
    reader = ReadDocuments(
        a.input, input_format=a.input_format, doc_per=a.doc_per, text_field=a.text_field, id_field=a.id_field,
        timestamp_field=a.timestamp_field, split_bytes=max(1, int(a.split_mb * 2**20)), min_splits=layout.workers,
        timestamp_required=a.event_time == "field", max_document_mb=a.max_document_mb)
    read = p | "Read" >> reader
    tokenized = read["documents"] | "Tokenize" >> TokenizeWithSpacy(
        lang=a.lang, model=a.spacy_model, max_sentence_tokens=a.max_sentence_tokens, segmenter=job.segmenter)
    sentences = tokenized["sentences"]
    if a.event_time == "run":
        sentences = sentences | "RunTime" >> beam.Map(_with_event_time(job))
    embedded = (
        sentences
        | "Embed" >> EmbedSentences(a.model, a.device, a.precision, a.batch_tokens, a.max_batch_sentences,
                                    a.kernel, a.cache_size, a.large_model, a.sort_buffer_tokens, a.torch_threads,
                                    layout.workers if layout.separate_processes else 1, job.planned)
        | "Mix" >> MixLayers(job.mixes, job.spec.n_layers)
    )
    embedded | "WriteParquet" >> WriteParquet(a.output, job.spec, a.num_shards, a.row_group_mb)
    errors = [read["errors"], tokenized["errors"]]
    if not a.skip_id_check:
        errors.append(read["documents"] | "DuplicateIds" >> FindDuplicateIds())
    (tuple(errors) | "AllErrors" >> beam.Flatten()
     | "WriteErrors" >> WriteErrors(a.output))
    return len(reader.urls)


def summarize(result: Any, seconds: float, ids_checked: bool = False,
              expected: dict[str, int] | None = None) -> dict[str, Any]:
    """Counters from the finished job, and whether documents and tokens reconcile
    (`ids_unique` is None when document ids were not checked): documents_read (every record read,
    a read error included) = documents_tokenized + documents_rejected (read + tokenize errors).
    `vectors_finite` says whether every vector value written is finite in the output dtype
    (`nonfinite_values`; per column in `nonfinite_values_by_column`).

    `expected` holds counters whose value is known before the job (e.g. input_files): a runner
    that cannot report metrics, or reports fewer, fails that check, and then `counts_verified`
    is false with the reason in `counts_unverified_reason`, and every check that rests on the
    counts (`documents_reconcile`, `tokens_reconcile`, `ids_unique`, `vectors_finite`) is None.
    `tokens_embedded_on` maps "<device type>/<kernel>" to the tokens the workers embedded so."""
    counts = {name: 0 for name in m.COUNTERS}
    by_prefix: dict[str, dict[str, int]] = {m.EMBEDDED_ON: {}, m.NONFINITE_IN: {}}  # counters named per key
    counters, reason = m.job_counters(result)
    for name, value in counters:
        if name in counts:
            counts[name] += value
            continue
        for prefix, totals in by_prefix.items():
            if name.startswith(prefix):
                key = name[len(prefix):]
                totals[key] = totals.get(key, 0) + value
    for name, want in (expected or {}).items():
        if reason is None and counts[name] != want:
            reason = f"the runner reported {name} = {counts[name]}, but the job has {want}"
    verified = reason is None
    rejected = counts[m.READ_ERRORS] + counts[m.TOKENIZE_ERRORS]
    padded = counts[m.BATCH_PADDED_TOKENS]
    return {
        **counts,
        "tokens_embedded_on": by_prefix[m.EMBEDDED_ON],
        "nonfinite_values_by_column": by_prefix[m.NONFINITE_IN],
        "counts_verified": verified,
        "counts_unverified_reason": reason,
        "documents_rejected": rejected,
        "documents_reconcile": (counts[m.DOCUMENTS_READ] == counts[m.DOCUMENTS_TOKENIZED] + rejected
                                if verified else None),
        "tokens_reconcile": counts[m.TOKENS] == counts[m.TOKEN_ROWS_WRITTEN] if verified else None,
        "ids_unique": counts[m.DUPLICATE_DOC_IDS] == 0 if ids_checked and verified else None,
        "vectors_finite": counts[m.NONFINITE_VALUES] == 0 if verified else None,
        "padding_ratio": round(1 - counts[m.BATCH_TOKENS] / padded, 4) if padded else 0.0,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(counts[m.TOKENS] / seconds, 1) if seconds > 0 else None,
    }


def is_parquet_shard(name: str) -> bool:
    """A Parquet shard our sinks write: `sentences-`/`tokens-NNNNN-of-NNNNN.parquet`."""
    return PARQUET_SHARD.fullmatch(name) is not None


def base_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def rows_in_files(output: str, layout: str) -> int:
    """The rows of the finished `<layout>s-*` shards in `output`, read from their Parquet footers
    (no data page is read)."""
    fs, root = fsspec.core.url_to_fs(output)
    total = 0
    for entry in fs.ls(root, detail=True):
        name = base_name(entry["name"])
        # a user's folder named like a shard is kept by --overwrite, and is not ours
        if entry["type"] == "file" and name.startswith(f"{layout}s-") and is_parquet_shard(name):
            with fs.open(entry["name"], "rb") as f:
                total += pq.ParquetFile(f).metadata.num_rows
    return total


def files_check(summary: dict[str, Any], folders: Sequence[str], layout: str) -> dict[str, Any]:
    """Whether the shards in `folders` hold the rows the job counted into its sinks (token rows,
    or sentences for the sentence layout). The counts are taken before the sink's shuffle, and
    a runner that loses or repeats an element after them would otherwise pass every other check
    (one did: see transforms/data_plane.py). None where the counts are unverified."""
    counted = summary[m.TOKEN_ROWS_WRITTEN if layout == "token" else m.SENTENCES_WRITTEN]
    found = sum(rows_in_files(folder, layout) for folder in folders)
    return {"rows_counted": counted, "rows_in_files": found,
            "files_reconcile": found == counted if summary["counts_verified"] else None}


def error_records_in_files(output: str) -> int:
    """The records of the finished `errors-*` shards in `output`: one JSON object a line, whose
    strings hold no newline (JSON escapes it)."""
    fs, root = fsspec.core.url_to_fs(output)
    total = 0
    for entry in fs.ls(root, detail=True):
        if entry["type"] == "file" and ERRORS_SHARD.fullmatch(base_name(entry["name"])):
            with fs.open(entry["name"], "rb") as f:
                while chunk := f.read(1 << 20):
                    total += chunk.count(b"\n")
    return total


def errors_check(summary: dict[str, Any], output: str) -> dict[str, Any]:
    """Whether the `errors-*` shards in `output` hold the records the job counted into that sink
    (read errors, tokenize errors and a record per id used twice), as `files_check` checks the
    Parquet rows: a record lost after it was counted would leave its document unaccounted for."""
    counted = summary[m.READ_ERRORS] + summary[m.TOKENIZE_ERRORS] + summary[m.DUPLICATE_DOC_IDS]
    found = error_records_in_files(output)
    return {"error_records_counted": counted, "error_records_in_files": found,
            "errors_reconcile": found == counted if summary["counts_verified"] else None}


def run(args: argparse.Namespace, beam_args: Sequence[str]) -> dict[str, Any]:
    check_beam_args(beam_args, add_extract_args)
    make_paths_absolute(args)
    with output_claimed(args.output):
        job = prepare_job(args, beam_args)
        start = time.monotonic()
        planned: dict[str, int] = {}

        def build_job(p: beam.Pipeline) -> None:
            planned[m.INPUT_FILES] = build(p, job)

        result = run_pipeline(build_job, beam_args, "extract", args.output, job.earlier, writes=_is_run_file)
        summary = summarize(result, time.monotonic() - start, ids_checked=not args.skip_id_check, expected=planned)
        summary.update(files_check(summary, [args.output], job.spec.layout))
        summary.update(errors_check(summary, args.output))
        write_url_atomically(join_url(args.output, SUMMARY_FILE),
                             dumps_strict(summary, SUMMARY_FILE, indent=2).encode())
    return summary


# each check of summary.json that fails the command, and what it says on stderr when it does
_CHECKS: dict[str, Callable[[dict[str, Any]], str]] = {
    "documents_reconcile": lambda s: (
        f"{s['documents_read']} documents were read, but {s['documents_tokenized']} were tokenized and "
        f"{s['documents_rejected']} rejected (read and tokenize errors): documents were lost or doubled between "
        "reading and tokenizing"),
    "tokens_reconcile": lambda s: (
        f"{s['tokens']} tokens were tokenized, but {s['token_rows_written']} token rows were written: tokens were "
        "lost or doubled between tokenizing and writing"),
    "ids_unique": lambda s: (
        f"{s['duplicate_doc_ids']} document id(s) are used by several documents, each named in errors-*.jsonl: "
        "their token_ids are not unique"),
    "vectors_finite": lambda s: (
        f"{s['nonfinite_values']} vector values written are not finite (inf or NaN) in the output dtype, per column "
        f"{s['nonfinite_values_by_column']}: a mix whose gamma takes values past float16's 65504? Use --dtype "
        "float32 or a smaller gamma"),
    "files_reconcile": lambda s: (
        f"the Parquet shards hold {s['rows_in_files']} rows, but the job counted {s['rows_counted']} rows into its "
        "sink: rows were lost or doubled after they were counted (by the runner?)"),
    "errors_reconcile": lambda s: (
        f"the errors-*.jsonl files hold {s['error_records_in_files']} records, but the job counted "
        f"{s['error_records_counted']} into its sink: records were lost or doubled after they were counted (by the "
        "runner?)"),
}


def report(summary: dict[str, Any], allow_unverified: bool = False) -> int:
    """Prints the summary and returns the command's exit status: 1 when the counts do not
    reconcile (the files' rows and error records against those counted into the sinks included), a
    document id is used twice, a vector value written is not finite, or the counts could not be
    verified (unless `allow_unverified`); else 0."""
    print(dumps_strict(summary, SUMMARY_FILE, indent=2))
    if not summary["counts_verified"]:
        print(f"extract: the counts are unverified: {summary['counts_unverified_reason']}"
              + ("" if allow_unverified else "; pass --allow-unverified-counts to accept that"), file=sys.stderr)
        return 0 if allow_unverified else 1
    failed = [check for check in _CHECKS if summary[check] is False]
    for check in failed:
        print(f"extract: {_CHECKS[check](summary)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    return job_main("extract", __doc__, add_extract_args, run_and_report, argv)


def run_and_report(args: argparse.Namespace) -> int:
    """The job for parsed options (Beam's in `args.beam_args`): summary.json, then the exit status."""
    return report(run(args, args.beam_args), args.allow_unverified_counts)


if __name__ == "__main__":
    sys.exit(main())
