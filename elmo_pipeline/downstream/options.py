"""The options of `probe`, kept free of Beam so that the command line starts quickly."""

from __future__ import annotations

import argparse

from elmo_pipeline.corpus.options import int_in
from elmo_pipeline.embedding import DEFAULT_BATCH_TOKENS
from elmo_pipeline.embedding.options import add_whole_sentence_bound
from elmo_pipeline.runtime_choices import AUTO, KERNELS, MAX_SEED, MAX_TORCH_THREADS, PRECISIONS
from elmo_pipeline.corpus.schema import DTYPES, LAYOUTS
from elmo_pipeline.downstream.conll import FORMATS
from elmo_pipeline.downstream.probe_config import ProbeConfig


def add_probe_args(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument("data", nargs="?", default=None,
                      help="a folder with one *train*.conllu and one *dev*.conllu (instead of --train/--dev)")
    data.add_argument("--train", default=None, help="labelled training file (path or URL)")
    data.add_argument("--dev", default=None, help="labelled dev file (path or URL)")
    data.add_argument("--format", dest="conll_format", default="auto", choices=FORMATS,
                      help="labelled file format (auto: from each file's name or first lines; the two must agree)")
    data.add_argument("--label", default=None,
                      help="CoNLL-U column (upos, xpos, deprel...; default upos) or CoNLL-2003 column index (default -1)")
    data.add_argument("--output", required=True, help="output folder: features/, report.json, probe.png, mix.json")
    data.add_argument("--reuse-features", action="store_true",
                      help="train on the features already in <output>/features instead of extracting them again "
                           "(only features of the same --train/--dev files and --model are taken)")

    model = parser.add_argument_group("model and extraction")
    model.add_argument("--model", default=None,
                       help="model folder or URL, or OPTIONS.json,WEIGHTS.hdf5 (default: the embedded model)")
    model.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    model.add_argument("--precision", default="fp32", choices=PRECISIONS,
                       help="autocast precision of the biLM (fp16 on GPUs only)")
    model.add_argument("--kernel", default=AUTO, choices=KERNELS,
                       help="LSTM kernel: exact (clips; batch-invariant on CPU), fused (no clips), auto (exact on CPU)")
    model.add_argument("--batch-tokens", type=int_in(1), default=DEFAULT_BATCH_TOKENS,
                       help="tokens per model batch of the extraction")
    add_whole_sentence_bound(model, "a labelled sentence", "before any work")
    model.add_argument("--layout", default="sentence", choices=LAYOUTS, help="Parquet layout of the features")
    model.add_argument("--dtype", default="float16", choices=DTYPES, help="stored precision of the features")

    probe = parser.add_argument_group("probe")
    defaults = ProbeConfig()
    probe.add_argument("--epochs", type=int, default=defaults.epochs, help="passes over the train features")
    probe.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate of the probes (cosine decay)")
    probe.add_argument("--mix-lr", type=float, default=defaults.mix_lr,
                       help="Adam learning rate of the mix weights and gamma")
    probe.add_argument("--batch-sentences", type=int, default=defaults.batch_sentences,
                       help="sentences per training batch")
    probe.add_argument("--shuffle-buffer", type=int, default=defaults.shuffle_buffer,
                       help="sentences held for shuffling (0: file order)")
    probe.add_argument("--l2", type=float, default=defaults.l2_lambda, help="lambda of the mix weights' L2 penalty")
    probe.add_argument("--dropout", type=float, default=defaults.dropout, help="dropout on the mixed vector")
    probe.add_argument("--layer-norm", action="store_true", help="normalise each layer per token before mixing")
    probe.add_argument("--seed", type=int_in(0, MAX_SEED), default=defaults.seed,
                       help=f"seed of the probes' initial weights and shuffling, 0 to {MAX_SEED}")
    probe.add_argument("--mix-name", default="probe", help="name of the mix in mix.json (extract --mix NAME=...)")
    probe.add_argument("--name", default=None, help="task name for the report and chart (default: the file names)")
    probe.add_argument("--threads", type=int_in(1, MAX_TORCH_THREADS), default=None,
                       help="torch CPU threads (default: torch's choice)")
