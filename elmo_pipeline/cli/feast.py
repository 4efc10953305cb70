"""`elmo-pipeline feast-repo`: a Feast feature repository over extracted token features (feast/repo.py)."""

from __future__ import annotations

import argparse
import sys


def _feast_repo(args: argparse.Namespace) -> int:
    from elmo_pipeline.feast.repo import (RepoOptions, next_steps, parse_options, parse_ttl, replaced_warnings,
                                         run_warnings, served_by, time_warnings, write_repo)

    if not args.features.strip():  # an unset variable: the current folder's Parquet files were served
        raise ValueError(f"--features {args.features!r} names no folder, file or glob; give extract's output folder")
    if args.online_path is not None and not args.online_path.strip():  # taken for unset, the default path was written
        raise ValueError(f"--online-path {args.online_path!r} names no file; give one or leave the option out")
    for item in args.columns:
        if not any(c.strip() for c in item.split(",")):  # taken for unset, every vector column was served
            raise ValueError(f"--columns {item!r} names no column; leave it out to serve every vector column")
    if args.online_path is not None and args.online_store != "sqlite":
        raise ValueError("--online-path is for the sqlite online store; use --online-option for others")
    online_options = parse_options(args.online_option, "--online-option")
    if args.online_path is not None and "path" in online_options:  # one of the two would be dropped
        raise ValueError(f"--online-path {args.online_path} and --online-option path= both give the online store's "
                         "path: give one")
    columns = tuple(c.strip() for item in args.columns for c in item.split(",") if c.strip())
    options = RepoOptions(
        project=args.project, entity=args.entity, feature_view=args.feature_view,
        feature_service=args.feature_service, columns=columns, ttl=parse_ttl(args.ttl), provider=args.provider,
        registry=args.registry, offline_store=args.offline_store,
        offline_options=parse_options(args.offline_option, "--offline-option"),
        online_store=args.online_store,
        online_options={**({"path": args.online_path} if args.online_path is not None else {}), **online_options})
    before = served_by(args.output) if args.overwrite else None  # read before it is replaced
    files, written = write_repo(args.features, args.output, options, overwrite=args.overwrite)
    served = list(columns) or list(files.vector_columns)
    print(f"wrote {', '.join(written)}", file=sys.stderr)
    print(f"features: {files.source_path} ({len(files.files)} files, {files.num_rows} rows); "
          f"serving {', '.join(served)} as Array(Float32) x {files.width}", file=sys.stderr)
    for warning in (run_warnings(args.features, files) + replaced_warnings(before, args.output, files, options)
                    + time_warnings(files, options)):
        print(f"warning: {warning}", file=sys.stderr)
    if files.null_timestamps:
        print(f"warning: {files.null_timestamps} rows have no event_timestamp (documents without the timestamp "
              "field): materialize skips them, so they are never served online, while Feast's file offline "
              "store returns them at any entity time; give every document a time, or use --event-time run",
              file=sys.stderr)
    print("next:", file=sys.stderr)
    for step in next_steps(args.output, files):
        print(f"  {step}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "feast-repo", help="write a Feast repository (feature_store.yaml, features.py) for extracted features",
        description="Checks the token Parquet files of `extract` (token layout, event_timestamp, float32 "
                    "vectors) and writes a Feast repository: an entity keyed by token_id, a FileSource over "
                    "the files, a FeatureView with an Array(Float32) field per layer_J / mix_NAME column, and a "
                    "FeatureService. Then: feast apply; feast materialize START END; get_online_features.")
    p.add_argument("--features", required=True, metavar="DIR_OR_URL",
                   help="extract's output folder (its tokens-*.parquet), one Parquet file, or a glob; path or URL")
    p.add_argument("--output", required=True, metavar="REPO_DIR", help="the repository folder to write (local)")
    p.add_argument("--overwrite", action="store_true", help="replace feature_store.yaml and features.py there")
    names = p.add_argument_group("names")
    names.add_argument("--project", default="elmo", help="Feast project (default: elmo)")
    names.add_argument("--entity", default="token", help="entity name; its join key is token_id (default: token)")
    names.add_argument("--feature-view", default="elmo_tokens", help="feature view name (default: elmo_tokens)")
    names.add_argument("--feature-service", default="elmo_vectors",
                       help="feature service name (default: elmo_vectors)")
    names.add_argument("--columns", action="append", default=[], metavar="COL[,COL...]",
                       help="vector columns to serve (layer_J, mix_NAME); default: all in the files")
    names.add_argument("--ttl", default="0",
                       help="feature view TTL: 0 = never expire (default), or e.g. 3600s, 12h, 90d, 2w")
    stores = p.add_argument_group("stores (feature_store.yaml)")
    stores.add_argument("--provider", default="local", help="Feast provider (default: local)")
    stores.add_argument("--registry", default="data/registry.db",
                        help="registry path or URL, relative to the repo (default: data/registry.db)")
    stores.add_argument("--offline-store", default="file",
                        help="offline store type: file (pandas/dask, default) or another Feast type, e.g. duckdb")
    stores.add_argument("--offline-option", action="append", default=[], metavar="KEY=VALUE",
                        help="more offline_store settings; repeatable")
    stores.add_argument("--online-store", default="sqlite",
                        help="online store type: sqlite (default) or another Feast type, e.g. redis")
    stores.add_argument("--online-path", default=None,
                        help="SQLite file, relative to the repo (default: data/online_store.db)")
    stores.add_argument("--online-option", action="append", default=[], metavar="KEY=VALUE",
                        help="more online_store settings, e.g. connection_string=localhost:6379; repeatable")
    p.set_defaults(func=_feast_repo)
