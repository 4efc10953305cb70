"""The probe job: labelled token files -> the extract stages -> Parquet -> linear probes per layer.

    python -m elmo_pipeline.pipelines.probe --train en_ewt-ud-train.conllu --dev en_ewt-ud-dev.conllu \
        --output probe_ud_ewt [--model OPTIONS.json,WEIGHTS.hdf5]

Features are extracted with the file's own tokens (no re-tokenization) by the same Beam stages as
`extract` (EmbedSentences -> MixLayers -> WriteParquet), into `<output>/features/<split>/`, then
read back with `ParquetFeatureDataset`. The output folder gets:
    report.json   dev accuracy per layer and for the mix, learned weights and gamma, baselines
    probe.png     accuracy per layer and mix weights
    mix.json      the learned mix, for `extract --mix NAME=<output>/mix.json`
A new extraction first removes what an earlier run wrote there, by exact name (those three files,
and in each split's folder its Parquet shards and Beam's temporary folders); any other file stays.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import apache_beam as beam
import fsspec
import torch
from tqdm import tqdm
from elmo_pipeline.pipelines.extract import base_name, files_check, is_parquet_shard, summarize
from elmo_pipeline.pipelines.beam_options import check_beam_args, worker_layout, workers_run_here
from elmo_pipeline.pipelines.paths import make_paths_absolute, output_claimed
from elmo_pipeline.pipelines.runner import run_pipeline
from elmo_pipeline.transforms.embed import EmbedSentences
from elmo_pipeline.transforms.metrics import TOKENS
from elmo_pipeline.transforms.pretokenized import PretokenizedSentences, ReadTokenizedFiles
from elmo_pipeline.transforms.write import TEMP_FOLDER, WriteParquet

import elmo_pipeline
from elmo_pipeline.commands import job_main, options_given
from elmo_pipeline.formats.atomic import write_url_atomically
from elmo_pipeline.filesystems import open_url, url_to_fs, without_userinfo
from elmo_pipeline.formats.files import join_url, model_shown
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.layers_digest import layers_sha256
from elmo_pipeline.model.lstm import AUTO
from elmo_pipeline.runtime import check_precision, plan_runtime
from elmo_pipeline.downstream.conll import LabelledSentence, common_format, read_labelled
from elmo_pipeline.downstream.options import add_probe_args
from elmo_pipeline.downstream.dataset import ParquetFeatureDataset
from elmo_pipeline.downstream.probe import (LabelTable, ProbeConfig, ProbeResult, baselines, check_labelled,
                                            check_lengths, check_plotting, label_names, plot_report, train_probes)
from elmo_pipeline.corpus.input_files import InputError, expand_patterns
from elmo_pipeline.model.scalar_mix import MixSpec, dump_mix_specs
from elmo_pipeline.corpus.schema import OutputSpec, check_mix_name, layer_meanings
from elmo_pipeline.corpus.records import has_lone_surrogate

SPLITS = ("train", "dev")
RUN_FILES = ("report.json", "mix.json", "probe.png")  # written beside features/ from the features
SCORING_BATCH_TOKENS = 32_768  # padded tokens per dev batch (B * T): 32 MiB of float32 per layer of width 256


def resolve_files(args: argparse.Namespace) -> dict[str, str]:
    for split in SPLITS:  # an unset variable: `--train ''` beside a data folder was ignored
        given = getattr(args, split)
        if given is not None and not given.strip():
            raise ValueError(f"--{split} {given!r} names no file; give one (or a data folder)")
    if args.data is not None:
        if not args.data.strip():  # an unset variable: taken for none, --train/--dev ran, or the current folder
            raise ValueError(f"the data folder {args.data!r} names no folder; give one, or --train and --dev")
        if args.train is not None or args.dev is not None:
            raise ValueError("give a data folder or --train/--dev, not both")
        fs, folder = url_to_fs(args.data)
        if not fs.isdir(folder):
            raise ValueError(f"{args.data}: no such folder (give a folder with one *train*.conllu and one "
                             "*dev*.conllu, or --train and --dev)")
        files = {}
        for split in SPLITS:
            found = _find_split(args.data, split)
            if len(found) != 1:
                raise ValueError(f"{args.data}: expected one *{split}*.conllu file, found {found}")
            files[split] = found[0]
        return files
    if not (args.train and args.dev):
        raise ValueError("give --train and --dev (or a data folder)")
    return {"train": args.train, "dev": args.dev}


def _find_split(folder: str, split: str) -> list[str]:
    try:
        # the folder's own name is taken literally: `[1]` in it read as a glob matched no file
        return expand_patterns([join_url(glob.escape(folder), f"*{split}*.conllu*")])
    except InputError:
        return []


def feature_shards(folder: str) -> list[str]:
    """The Parquet shards in one split's folder, sorted, as URLs under `folder`. Only the shards:
    a file of the user's there (a `notes.parquet`) is neither read as features nor deleted."""
    fs, root = fsspec.core.url_to_fs(folder)
    if not fs.isdir(root):
        return []
    names = sorted(base_name(path) for path in fs.ls(root, detail=False))
    return [join_url(folder, name) for name in names if is_parquet_shard(name)]


def clear_earlier_run(output: str, splits: Sequence[str], replaces: Sequence[str] = ()) -> None:
    """Removes, by exact name, what an earlier run wrote: the files in `replaces` (made from its
    features) and in `<output>/<split>/` the shards and the temporary folders a sink left. A
    split's path that is a file is refused before anything is removed."""
    fs, root = fsspec.core.url_to_fs(output)
    folders = [join_url(root, split) for split in splits]
    for split, folder in zip(splits, folders):
        if fs.exists(folder) and not fs.isdir(folder):
            raise ValueError(f"{join_url(output, split)} is a file, where the probe writes the {split} features "
                             "(a folder): move it away")
    for url in replaces:
        url_fs, path = fsspec.core.url_to_fs(url)
        if url_fs.exists(path):
            url_fs.rm(path)
    for folder in folders:
        if not fs.isdir(folder):
            continue
        for entry in fs.ls(folder, detail=True):
            name = base_name(entry["name"])
            ours = TEMP_FOLDER.fullmatch(name) if entry["type"] == "directory" else is_parquet_shard(name)
            if ours:
                fs.rm(entry["name"], recursive=True)


def extract_features(
    files: dict[str, str], output: str, model: str | None = None, fmt: str = "auto", layout: str = "sentence",
    dtype: str = "float16", device: str = "auto", precision: str = "fp32", kernel: str = AUTO,
    batch_tokens: int = 8192, beam_args: Sequence[str] = (), expected_tokens: int | None = None,
    replaces: Sequence[str] = (), torch_threads: int = 0,
) -> dict[str, Any]:
    """Embeds the sentences of each labelled file into `<output>/<split>/` with the extract stages.
    doc_id is the split name and sentence_index the sentence's position in its file.
    `expected_tokens` (the tokens of the files) must come back in the runner's counters: a runner
    whose metrics cannot be read or are incomplete raises RuntimeError instead of a vacuous check.
    Once the model has loaded, the earlier features go (`clear_earlier_run`), and with them the
    files in `replaces` that were made from them, so a run that fails leaves no report beside
    features it does not describe. `torch_threads` (0: automatic) is each worker's torch thread
    count, as extract's --torch-threads: probe's --threads reaches worker processes too."""
    bilm = BiLM.load(model, cache_size=0, kernel=kernel)  # fused for a model with clips stops here
    planned = plan_runtime(bilm, device, kernel, workers_run_here(beam_args))
    if planned.device is not None:  # fp16 on a CPU stops here, before the job, as in extract
        check_precision(torch.device(planned.device), precision)
    n_layers, width = bilm.config.n_output_layers, bilm.config.output_dim
    metadata = {
        "package_version": elmo_pipeline.__version__,
        "model": {"location": model_shown(model), "name": bilm.config.name, "sha256": bilm.checksum,
                  "layers_sha256": layers_sha256(bilm), "config": bilm.config.to_dict()},
        "mixes": {},
        "tokenizer": {"library": "pretokenized", "files": files_shown(files), "files_sha256": file_digests(files),
                      "format": fmt},
        "layers": layer_meanings(n_layers),
        "dtype": dtype,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    spec = OutputSpec(n_layers=n_layers, width=width, layout=layout, layers="all", dtype=dtype, metadata=metadata)
    clear_earlier_run(output, list(files), replaces)
    start = time.monotonic()
    with_model = {"model": model, "device": device, "precision": precision, "batch_tokens": batch_tokens,
                  "kernel": kernel, "torch_threads": torch_threads}

    def build(p: beam.Pipeline) -> None:
        machine = worker_layout(p.options)
        workers = machine.workers if machine.separate_processes else 1
        for split, url in files.items():
            (p
             | f"Read_{split}" >> ReadTokenizedFiles({split: url}, fmt)
             | f"Sentences_{split}" >> PretokenizedSentences()
             | f"Embed_{split}" >> EmbedSentences(**with_model, workers=workers)
             | f"Write_{split}" >> WriteParquet(join_url(output, split), spec))

    result = run_pipeline(build, beam_args, "probe", output)
    summary = summarize(result, time.monotonic() - start,
                        expected=None if expected_tokens is None else {TOKENS: expected_tokens})
    if not summary["counts_verified"]:
        raise RuntimeError(f"the extraction's counts cannot be verified: {summary['counts_unverified_reason']}")
    summary.update(files_check(summary, [join_url(output, split) for split in files], layout))
    if not summary["files_reconcile"]:
        raise RuntimeError(f"the extracted features hold {summary['rows_in_files']} rows, but the job counted "
                           f"{summary['rows_counted']} into its sinks")
    return {k: summary[k] for k in ("sentences", "tokens", "token_rows_written", "tokens_reconcile", "rows_in_files",
                                    "files_reconcile", "batches", "padding_ratio", "seconds", "tokens_per_second")}


def files_shown(files: dict[str, str]) -> dict[str, str]:
    """The labelled files as the features' metadata and report.json record them: each URL without
    its `user:password@`, which every file written would carry (the query stays, as in extract's ids)."""
    return {split: without_userinfo(url) for split, url in files.items()}


def file_digests(files: dict[str, str]) -> dict[str, str]:
    """sha256 of each labelled file's bytes: what the features were extracted from, whatever the
    path it was named by."""
    digests = {}
    for split, url in files.items():
        digest = hashlib.sha256()
        with open_url(url) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digests[split] = digest.hexdigest()
    return digests


def split_features(folder: str) -> list[str]:
    """The shards of one split that a probe run wrote, or a ValueError saying how to make them."""
    shards = feature_shards(folder)
    if not shards:
        raise ValueError(f"{folder} holds no features (sentences-/tokens-NNNNN-of-NNNNN.parquet): run probe "
                         "without --reuse-features to extract them")
    return shards


def check_reused_features(folder: str, files: dict[str, str], checksum: str | None = None,
                          model: str | None = None, layers: str | None = None) -> None:
    """Features that `--reuse-features` may pair with `files`' labels: those extracted from files
    of the same content (features of an earlier version, which recorded no digests: of the same
    paths). Others would train each label against another sentence's vectors. With `checksum`
    (the sha256 of `model`, as loaded), they must also be that model's: another model's layers
    would give its report and a mix.json that `extract --model MODEL` applies to other layers. The
    same model read from other files (its `import-allennlp` folder) has the same `layers` digest."""
    features = ParquetFeatureDataset(split_features(folder))
    features.check_files()
    metadata = features.metadata
    tokenizer = metadata.get("tokenizer", {})
    recorded, digests = tokenizer.get("files"), tokenizer.get("files_sha256")
    # an earlier version recorded no digests, and the paths as given: compared as recorded now
    same = (digests == file_digests(files) if digests is not None
            else isinstance(recorded, dict) and files_shown(recorded) == files_shown(files))
    if not same:
        raise ValueError(f"{folder} holds the features of {recorded}, not of {files} as they are now: run probe "
                         "without --reuse-features to extract them for these files")
    made_with = metadata.get("model") or {}
    same_layers = layers is not None and made_with.get("layers_sha256") == layers
    if checksum is not None and made_with.get("sha256") != checksum and not same_layers:
        asked = f"--model {model!r}" if model else "the embedded default model (no --model)"
        raise ValueError(f"{folder} holds features extracted with the model {made_with.get('location')!r} (sha256 "
                         f"{str(made_with.get('sha256'))[:12]}), not with {asked} (sha256 {checksum[:12]}): run "
                         "probe without --reuse-features to extract them with this model, or give --model the "
                         "model they were made with")


EXTRACTION_OPTIONS = ("device", "precision", "kernel", "batch_tokens", "layout", "dtype")  # read by extract_features


def check_reuse_reads(args: argparse.Namespace, beam_args: Sequence[str]) -> None:
    """With `--reuse-features` nothing is extracted: an extraction option given a value other
    than its default, or a Beam argument, would be ignored, so it is refused by name."""
    if not args.reuse_features:
        return
    asked = options_given(args, add_probe_args)
    given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in EXTRACTION_OPTIONS
             if name in asked] + ([" ".join(beam_args)] if beam_args else [])
    if given:
        raise ValueError(f"--reuse-features trains on the features already extracted, so {', '.join(given)} "
                         "would change nothing: leave them out, or run without --reuse-features to extract again")


def features_for(args: argparse.Namespace, files: dict[str, str], fmt: str,
                 sentences: dict[str, list[LabelledSentence]], beam_args: Sequence[str],
                 log: Callable[[str], None]) -> dict[str, Any] | None:
    """Extracts the features into `<output>/features` (the extraction's summary), or with
    `--reuse-features` checks that those there are of these files and this model (None)."""
    features = join_url(args.output, "features")
    if args.reuse_features:
        bilm = BiLM.load(args.model, cache_size=0)
        layers = layers_sha256(bilm)
        for split in files:
            check_reused_features(f"{features}/{split}", files, bilm.checksum, args.model, layers)
        log(f"reusing the features in {features}")
        return None
    log(f"extracting features for {sum(len(s) for s in sentences.values())} sentences into {features}")
    extraction = extract_features(files, features, args.model, fmt, args.layout, args.dtype,
                                  args.device, args.precision, args.kernel, args.batch_tokens, beam_args,
                                  sum(len(s.tokens) for split in sentences.values() for s in split),
                                  replaces=[join_url(args.output, name) for name in RUN_FILES],
                                  torch_threads=args.threads or 0)
    log(f"extracted {extraction['tokens']} tokens in {extraction['seconds']} s")
    if not extraction["tokens_reconcile"]:
        raise RuntimeError(f"token rows written ({extraction['token_rows_written']}) != tokens ({extraction['tokens']})")
    return extraction


def run_probe(args: argparse.Namespace, beam_args: Sequence[str] = (),
              log: Callable[[str], None] = lambda m: tqdm.write(m, file=sys.stderr)) -> dict[str, Any]:
    check_beam_args(beam_args, add_probe_args)
    check_reuse_reads(args, beam_args)
    check_plotting()
    make_paths_absolute(args)
    check_mix_name(args.mix_name)
    if args.name is not None and has_lone_surrogate(args.name):  # matplotlib's traceback after the training
        raise ValueError(f"--name {args.name!r} is not UTF-8 text (bytes the shell passed as they were); give it "
                         "in UTF-8")
    with output_claimed(args.output):  # checked writable by Beam's Parquet sink first
        return _probe(args, beam_args, log)


def _probe(args: argparse.Namespace, beam_args: Sequence[str], log: Callable[[str], None]) -> dict[str, Any]:
    """run_probe's work, once it holds the output folder."""
    if args.threads:
        torch.set_num_threads(args.threads)
    files = resolve_files(args)
    features = join_url(args.output, "features")
    label = args.label
    fmt = args.conll_format if args.conll_format != "auto" else common_format(files)
    sentences = {split: list(read_labelled(url, fmt, label)) for split, url in files.items()}
    check_labelled(sentences, files)
    check_lengths(sentences, files, args.max_sentence_tokens)
    names = label_names(sentences["train"])
    known = set(names)
    unseen = dict(sorted(Counter(lab for s in sentences["dev"] for lab in s.labels
                                 if lab is not None and lab not in known).items()))
    if unseen:  # no probe can predict them: each is scored as an error
        log(f"note: {sum(unseen.values())} dev tokens carry labels the train file never has "
            f"({', '.join(unseen)}); they are scored as errors")
    config = ProbeConfig(epochs=args.epochs, lr=args.lr, mix_lr=args.mix_lr, batch_sentences=args.batch_sentences,
                         shuffle_buffer=args.shuffle_buffer, l2_lambda=args.l2, dropout=args.dropout,
                         layer_norm=args.layer_norm, seed=args.seed)  # checked here: before the extraction
    extraction = features_for(args, files, fmt, sentences, beam_args, log)
    train = train_features(split_features(f"{features}/train"), config)
    dev = scoring_features(split_features(f"{features}/dev"))
    result = train_probes(train, dev, LabelTable("train", sentences["train"], names),
                          LabelTable("dev", sentences["dev"], names), len(names), config, log)
    model_meta = train.metadata.get("model", {})
    report = {
        "task": {"name": args.name or " -> ".join(u.rsplit("/", 1)[-1] for u in files.values()),
                 "files": files_shown(files), "label": label or ("upos" if fmt == "conllu" else "column -1"),
                 "format": fmt, "labels": names, "train_sentences": len(sentences["train"]),
                 "dev_sentences": len(sentences["dev"]),
                 "unlabelled_tokens": {split: sum(lab is None for s in found for lab in s.labels)
                                       for split, found in sentences.items()},
                 "dev_labels_unseen_in_train": unseen},
        "model": {k: model_meta.get(k) for k in ("location", "name", "sha256", "layers_sha256")},
        "accuracy": result.accuracy,
        "best_layer": result.best_layer,
        "mix_minus_best_layer": result.accuracy["mix"] - result.accuracy[result.best_layer],
        "mix": {"name": args.mix_name, "weights": result.mix_weights, "raw_weights": result.mix_raw_weights,
                "gamma": result.gamma, "layer_norm": result.layer_norm},
        "baselines": baselines(sentences["train"], sentences["dev"]),
        "train_accuracy": result.train_accuracy,
        "loss_per_epoch": result.loss_per_epoch,
        "train_tokens": result.train_tokens,
        "dev_tokens": result.dev_tokens,
        "probe_config": result.config,
        "extraction": extraction,
        "train_seconds": result.seconds,
        "package_version": elmo_pipeline.__version__,
    }
    publish_run_files(args.output, {
        "probe.png": plot_report(report),
        "mix.json": (dump_mix_specs({args.mix_name: learned_mix(result, model_meta.get("layers_sha256"))})
                     + "\n").encode(),
        "report.json": dumps_strict(report, "report.json", indent=2).encode(),  # last: the run is done
    })
    return report


def train_features(shards: Sequence[str], config: ProbeConfig) -> ParquetFeatureDataset:
    """The train features in batches of up to `config.batch_sentences` sentences and
    `config.batch_tokens` padded tokens, drawn through its shuffle buffer. With no token bound, a
    file of long sentences made batches as large as the sentences' count allowed."""
    return ParquetFeatureDataset(shards, batch_sentences=config.batch_sentences, batch_tokens=config.batch_tokens,
                                 shuffle_buffer=config.shuffle_buffer, shuffle_tokens=config.shuffle_tokens,
                                 seed=config.seed)


def scoring_features(shards: Sequence[str]) -> ParquetFeatureDataset:
    """The dev features in batches of up to 256 sentences and SCORING_BATCH_TOKENS padded tokens:
    with no token bound, 255 short sentences padded to one of 3,000 tokens took 2.2 GiB (default
    model), and a longer one could exhaust memory. Each token is scored on its own, whatever
    batch it is in."""
    return ParquetFeatureDataset(shards, batch_sentences=256, batch_tokens=SCORING_BATCH_TOKENS)


def learned_mix(result: ProbeResult, layers: str | None) -> MixSpec:
    """The mix spec of what the probe learned, on the layers of digest `layers` (`layers_sha256`
    in the features' metadata), or a ValueError naming what to change: a gamma past what a mix spec
    takes (a large --mix-lr) failed inside pydantic, naming no option."""
    try:
        return result.mix_spec(layers)
    except ValueError as exc:
        raise ValueError(f"the learned mix is not a valid mix spec (gamma {result.gamma:.6g}, weights "
                         f"{[round(w, 4) for w in result.mix_raw_weights]}): {str(exc).splitlines()[-1].strip()}; "
                         "train it with a smaller --mix-lr") from None


def publish_run_files(output: str, files: dict[str, bytes]) -> None:
    """The run's files, every one built before any is written, the earlier run's removed first:
    a failure part way leaves some of this run's files, never one run's report beside another
    run's mix.json (a gamma past range failed after report.json was replaced)."""
    for name in RUN_FILES:
        fs, path = fsspec.core.url_to_fs(join_url(output, name))
        if fs.exists(path):
            fs.rm(path)
    for name, data in files.items():
        write_url_atomically(join_url(output, name), data)


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{'probe':<10} {'dev acc':>8}  {'mix weight':>10}"]
    weights = report["mix"]["weights"]
    for name, acc in report["accuracy"].items():
        w = f"{weights[int(name.split('_')[1])]:.3f}" if name.startswith("layer_") else ""
        lines.append(f"{name:<10} {100 * acc:>7.2f}%  {w:>10}")
    lines.append(f"best layer: {report['best_layer']}; mix gamma {report['mix']['gamma']:.3f}")
    for name, acc in report["baselines"].items():
        lines.append(f"baseline {name}: {100 * acc:.2f}%")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return job_main("probe", __doc__, add_probe_args, run_and_print, argv)


def run_and_print(args: argparse.Namespace) -> int:
    """The probe for parsed options (Beam's in `args.beam_args`), its table printed."""
    print(format_report(run_probe(args, args.beam_args)))
    print(f"wrote {join_url(args.output, 'report.json')}, probe.png, mix.json (use: extract --mix "
          f"{args.mix_name}={join_url(args.output, 'mix.json')})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
