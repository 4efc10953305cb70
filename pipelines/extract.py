"""The main job: read -> tokenize with spaCy -> embed with the biLM -> mix -> Parquet.

    python -m elmo_pipeline.pipelines.extract --input 'gs://bucket/corpus/*.txt.gz' --output gs://bucket/features \
        [--runner DataflowRunner ...any Beam option]

Without `--runner` the job runs locally on Beam's FnApiRunner, which downloads nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import apache_beam as beam
import fsspec
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

import elmo_pipeline
from elmo_pipeline.checkpoints import load_model
from elmo_pipeline.runtime import PRECISIONS
from elmo_pipeline.scalar_mix import PRESETS, MixSpec, load_mix_specs
from elmo_pipeline.schema import DTYPES, LAYER_CHOICES, LAYOUTS, OutputSpec, check_mix_name, layer_meanings
from elmo_pipeline.transforms.embed import EmbedSentences
from elmo_pipeline.transforms.mix import MixLayers
from elmo_pipeline.transforms.read import ReadDocuments
from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy
from elmo_pipeline.transforms.write import WriteErrors, WriteParquet

LOCAL_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"
SUMMARY_FILE = "summary.json"
COUNTERS = ("documents_read", "read_errors", "documents_tokenized", "empty_documents", "tokenize_errors",
            "sentences", "tokens", "windows_cut", "batches", "batch_tokens", "batch_padded_tokens", "oom_splits",
            "token_rows_written", "sentences_written")


def add_extract_args(parser: argparse.ArgumentParser) -> None:
    io = parser.add_argument_group("input and output")
    io.add_argument("--input", action="append", required=True, metavar="GLOB",
                    help="fsspec URL or glob of input files; repeatable; .gz/.bz2/.xz/.zst by extension")
    io.add_argument("--output", required=True, help="output folder (path or URL) for Parquet, errors and summary")
    io.add_argument("--overwrite", action="store_true", help="replace earlier output in --output")
    io.add_argument("--format", dest="input_format", default="text", choices=("text", "jsonl", "parquet"))
    io.add_argument("--doc-per", default="line", choices=("line", "file"), help="text format: a document per line or per file")
    io.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    io.add_argument("--id-field", default=None, help="JSONL field / Parquet column holding the document id")
    io.add_argument("--timestamp-field", default=None,
                    help="JSONL field / Parquet column with an ISO 8601 event time for the event_timestamp column")
    io.add_argument("--event-time", default="none", choices=("none", "field", "run"),
                    help="add an event_timestamp column from --timestamp-field or the run's start time")
    io.add_argument("--split-mb", type=float, default=64.0, help="split large uncompressed files into ranges of this size")

    tok = parser.add_argument_group("tokenization")
    tok.add_argument("--lang", default="en", help="spaCy language code of the blank pipeline (en, zh, de, ...)")
    tok.add_argument("--spacy-model", default=None, help="an installed spaCy pipeline to use instead of a blank one")
    tok.add_argument("--max-sentence-tokens", type=int, default=256, help="longer sentences are cut into windows")

    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="model folder or URL, or OPTIONS.json,WEIGHTS.hdf5 (default: the embedded model)")
    model.add_argument("--device", default="auto", help="auto, cpu, cuda (default: auto)")
    model.add_argument("--precision", default="fp32", choices=PRECISIONS)
    model.add_argument("--kernel", default="auto", choices=("auto", "exact", "fused"))
    model.add_argument("--batch-tokens", type=int, default=8192, help="tokens per model batch, <S>/</S> included (sentences are length-sorted first)")
    model.add_argument("--max-batch-sentences", type=int, default=1024)
    model.add_argument("--cache-size", type=int, default=100_000, help="words in the char-CNN cache (0: off)")
    model.add_argument("--large-model", action="store_true", help="one model per machine, shared by its processes")

    out = parser.add_argument_group("features")
    out.add_argument("--layout", default="token", choices=LAYOUTS)
    out.add_argument("--layers", default="all", choices=LAYER_CHOICES)
    out.add_argument("--dtype", default="float16", choices=DTYPES)
    out.add_argument("--mix", action="append", default=[], metavar="NAME=SOURCE",
                     help="add column mix_NAME; SOURCE is a preset (average, top) or a mix JSON file; repeatable")
    out.add_argument("--num-shards", type=int, default=0, help="Parquet shards (0: the runner decides)")
    out.add_argument("--row-group-mb", type=float, default=64.0, help="uncompressed vector MiB per row group")


def parse_mixes(items: Sequence[str], n_layers: int) -> dict[str, MixSpec]:
    """`NAME=average|top|FILE`; from a file holding several mixes, the one called NAME is taken."""
    specs: dict[str, MixSpec] = {}
    for item in items:
        name, sep, source = item.partition("=")
        if not sep or not source:
            raise ValueError(f"--mix {item!r}: expected NAME=SOURCE")
        check_mix_name(name)
        if name in specs:
            raise ValueError(f"--mix {name!r} is given twice")
        if source in PRESETS:
            specs[name] = MixSpec.preset(source, n_layers)
            continue
        with fsspec.open(source, "rb") as f:
            found = load_mix_specs(f.read(), source)
        if len(found) == 1:
            specs[name] = next(iter(found.values()))
        elif name in found:
            specs[name] = found[name]
        else:
            raise ValueError(f"--mix {item!r}: {source} holds {sorted(found)}, not {name!r}")
    return specs


@dataclass
class ExtractJob:
    """Everything decided before the pipeline starts: failures here come before any data is read."""

    args: argparse.Namespace
    spec: OutputSpec
    mixes: dict[str, MixSpec]
    started: str


def prepare_job(args: argparse.Namespace) -> ExtractJob:
    if args.event_time == "field" and not args.timestamp_field:
        raise ValueError("--event-time field needs --timestamp-field")
    model = load_model(args.model, cache_size=0)  # validates the files; workers load their own copy
    n_layers, width = model.config.n_output_layers, model.config.output_dim
    mixes = parse_mixes(args.mix, n_layers)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    metadata = {
        "package_version": elmo_pipeline.__version__,
        "model": {"location": args.model or "embedded default", "name": model.config.name,
                  "sha256": model.checksum, "config": model.config.to_dict()},
        "mixes": {name: spec.to_dict() for name, spec in mixes.items()},
        "tokenizer": {"library": "spacy", "lang": args.lang, "model": args.spacy_model,
                      "max_sentence_tokens": args.max_sentence_tokens},
        "layers": layer_meanings(n_layers),
        "dtype": args.dtype,
        "started": started,
    }
    spec = OutputSpec(n_layers=n_layers, width=width, layout=args.layout, layers=args.layers, dtype=args.dtype,
                      mix_names=tuple(mixes), with_timestamp=args.event_time != "none", metadata=metadata)
    _check_output(args.output, args.overwrite)
    return ExtractJob(args, spec, mixes, started)


def _check_output(output: str, overwrite: bool) -> None:
    """Stale shards of an earlier run would be read as part of this one: refuse, or clear them."""
    try:  # the Parquet and error sinks are Beam's: a scheme it cannot write (memory://) fails now, not at the end
        FileSystems.get_filesystem(output)
    except ValueError as exc:
        raise ValueError(f"--output {output}: Beam's file sinks cannot write there ({exc})") from exc
    fs, root = fsspec.core.url_to_fs(output)
    if not fs.exists(root):
        return
    ours = [p for p in fs.ls(root, detail=False)
            if p.rsplit("/", 1)[-1].split("-")[0] in ("tokens", "sentences", "errors") or p.endswith(SUMMARY_FILE)]
    if ours and not overwrite:
        raise ValueError(f"{output} already holds output of an earlier run ({len(ours)} files); use --overwrite")
    for path in ours:
        fs.rm(path)


def _with_event_time(job: ExtractJob):
    def stamp(sentence):
        return sentence._replace(timestamp=job.started)
    return stamp


def build(p: beam.Pipeline, job: ExtractJob) -> None:
    a = job.args
    read = p | "Read" >> ReadDocuments(
        a.input, input_format=a.input_format, doc_per=a.doc_per, text_field=a.text_field, id_field=a.id_field,
        timestamp_field=a.timestamp_field, split_bytes=max(1, int(a.split_mb * 2**20)))
    tokenized = read["documents"] | "Tokenize" >> TokenizeWithSpacy(
        lang=a.lang, model=a.spacy_model, max_sentence_tokens=a.max_sentence_tokens)
    sentences = tokenized["sentences"]
    if a.event_time == "run":
        sentences = sentences | "RunTime" >> beam.Map(_with_event_time(job))
    embedded = (
        sentences
        | "Embed" >> EmbedSentences(a.model, a.device, a.precision, a.batch_tokens, a.max_batch_sentences,
                                    a.kernel, a.cache_size, a.large_model)
        | "Mix" >> MixLayers(job.mixes, job.spec.n_layers)
    )
    embedded | "WriteParquet" >> WriteParquet(a.output, job.spec, a.num_shards, a.row_group_mb)
    ((read["errors"], tokenized["errors"]) | "AllErrors" >> beam.Flatten()
     | "WriteErrors" >> WriteErrors(a.output))


def summarize(result: Any, seconds: float) -> dict[str, Any]:
    """Counters from the finished job, and whether documents and tokens reconcile."""
    counts = {name: 0 for name in COUNTERS}
    for counter in result.metrics().query(beam.metrics.MetricsFilter())["counters"]:
        name = counter.key.metric.name
        if name in counts and counter.key.metric.namespace == "elmo_pipeline":
            value = counter.committed if counter.committed is not None else counter.attempted
            counts[name] += value or 0
    rejected = counts["read_errors"] + counts["tokenize_errors"]
    padded = counts["batch_padded_tokens"]
    return {
        **counts,
        "documents_rejected": rejected,
        "documents_reconcile": counts["documents_read"] == counts["documents_tokenized"] + counts["tokenize_errors"],
        "tokens_reconcile": counts["tokens"] == counts["token_rows_written"],
        "padding_ratio": round(1 - counts["batch_tokens"] / padded, 4) if padded else 0.0,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(counts["tokens"] / seconds, 1) if seconds > 0 else None,
    }


def run(args: argparse.Namespace, beam_args: Sequence[str]) -> dict[str, Any]:
    job = prepare_job(args)
    beam_args = list(beam_args)
    if not any(arg == "--runner" or arg.startswith("--runner=") for arg in beam_args):
        beam_args.append(f"--runner={LOCAL_RUNNER}")
    start = time.monotonic()
    p = beam.Pipeline(options=PipelineOptions(beam_args))
    build(p, job)
    result = p.run()
    result.wait_until_finish()
    summary = summarize(result, time.monotonic() - start)
    with fsspec.open(f"{args.output.rstrip('/')}/{SUMMARY_FILE}", "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elmo-pipeline extract", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_extract_args(parser)
    args, beam_args = parser.parse_known_args(argv)
    summary = run(args, beam_args)
    print(json.dumps(summary, indent=2))
    return 0 if summary["documents_reconcile"] and summary["tokens_reconcile"] else 1


if __name__ == "__main__":
    sys.exit(main())
