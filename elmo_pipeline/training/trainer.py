"""`pretrain`: training and fine-tuning the biLM on a prepared corpus.

- Objective: 0.5 * (forward NLL + backward NLL), token encoder and softmax shared by both
  directions (see `lm.py`); every sentence starts from a zero state, as in extraction.
- Optimizer: Adagrad (learning rate 0.2, initial accumulator 1.0, as the original) or Adam;
  a linear warmup, then a constant, linear or cosine learning rate (torch's LambdaLR);
  global gradient-norm clip; gradient accumulation; bf16 autocast (`precision`) on GPU or CPU,
  the parameters, their gradients, the optimizer state and the LSTM cell state in float32.
- Several processes through torchrun (DistributedDataParallel, NCCL or gloo).
- Checkpoints every N steps (and/or every S seconds) and at the end, atomically, the last K
  kept. Running the same command again resumes from the newest checkpoint exactly: model,
  optimizer, every process's random state and the data position.
- `init`: continue from a native model (its vocabulary grows with the corpus's new words)
  or from original weights (`options.json,weights.hdf5`: no softmax, a new one is built).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any, Callable, Collection, ContextManager, Iterator, TextIO

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from elmo_pipeline.filesystems import local_folder
from elmo_pipeline.formats.atomic import check_output_folder, recover_folder, replace_folder, write_url_atomically
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.lstm import AUTO, check_kernel
from elmo_pipeline.model.config import NATIVE_FORMAT, NATIVE_FORMAT_VERSION, ElmoConfig, SoftmaxConfig
from elmo_pipeline.strict import ConfigError, dumps_strict
from elmo_pipeline.model.softmax import default_cutoffs
from elmo_pipeline.model.vocabulary import Vocabulary
from elmo_pipeline.progress import note_tokens, progress_bar
from elmo_pipeline.runtime import MAX_SEED, MAX_TORCH_THREADS, TRAIN_PRECISIONS, autocast, check_precision
from elmo_pipeline.training import checkpointing as ckpt
from elmo_pipeline.training.data import BatchStream, Position
from elmo_pipeline.training.distributed import DistContext, init_distributed
from elmo_pipeline.training.evaluate import NonFinitePerplexity, check_sentences, data_sentences, evaluate_sentences
from elmo_pipeline.training.lm import LmObjective, make_batch, run_objective
from elmo_pipeline.training.shards import PreparedCorpus, vocab_digest

PRESETS: dict[str, dict[str, Any]] = {
    # For tests: a few thousand parameters.
    "tiny": {
        "token_encoder": "char_cnn",
        "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4], [2, 8]], "n_highway": 1},
        "lstm": {"dim": 16, "projection_dim": 8, "n_layers": 2, "use_skip_connections": True},
        "softmax": {"kind": "full"},
    },
    # The shipped default model: trainable on one CPU core in about an hour, < 25 MB in fp16.
    "small-cpu": {
        "token_encoder": "char_cnn+word",
        "word_embedding_dim": 128,
        "char_cnn": {"embedding": {"dim": 16}, "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 128]],
                     "n_highway": 1},
        "lstm": {"dim": 512, "projection_dim": 128, "n_layers": 2, "use_skip_connections": True},
        "softmax": {"kind": "adaptive", "cutoffs": [2000, 10000], "div_value": 4.0},
    },
    # A candidate default model for one GPU (benchmarks/gpu_train_default.py): 15.5M parameters,
    # 29.5 MiB in fp16, so that the checkout still travels to a lent GPU with its wheels.
    "wt2-gpu": {
        "token_encoder": "char_cnn+word",
        "word_embedding_dim": 64,
        "char_cnn": {"embedding": {"dim": 16},
                     "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512]], "n_highway": 1},
        "lstm": {"dim": 1024, "projection_dim": 256, "n_layers": 2, "use_skip_connections": True},
        "softmax": {"kind": "adaptive", "cutoffs": [2000, 10000], "div_value": 4.0},
    },
    # AllenNLP's "Small" shape (13.6M parameters without the softmax).
    "small": {
        "token_encoder": "char_cnn",
        "char_cnn": {"embedding": {"dim": 16},
                     "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]],
                     "n_highway": 1},
        "lstm": {"dim": 1024, "projection_dim": 128, "n_layers": 2, "use_skip_connections": True,
                 "cell_clip": 3.0, "proj_clip": 3.0},
        "softmax": {"kind": "sampled", "n_samples": 8192},
    },
}

OPTIMIZERS = ("adagrad", "adam")
# the older `bf16` option's values (run.json files of earlier versions hold them) -> precision
BF16_ALIASES = {"auto": "auto", "on": "bf16", "true": "bf16", "1": "bf16", "off": "fp32", "false": "fp32",
                "0": "fp32"}


def precision_from_bf16(value: str, where: str = "--bf16") -> str:
    """The precision the older `bf16` option's value means (`on` is bf16 on any device now)."""
    key = str(value).lower()
    if key not in BF16_ALIASES:
        raise ValueError(f"{where} {value!r}: use auto, on or off")
    return BF16_ALIASES[key]


def training_precision(precision: str, device: torch.device) -> str:
    """`fp32` or `bf16` for a run on `device`: auto is bf16 on CUDA and fp32 elsewhere; bf16 on a
    device without native bf16 products runs, with runtime's SlowPrecisionWarning."""
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"--precision {precision!r}: training takes one of {TRAIN_PRECISIONS}")
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return check_precision(device, precision)


def resolve_softmax(raw: dict[str, Any], vocab_size: int, kind: str | None = None, n_samples: int | None = None,
                    cutoffs: list[int] | None = None) -> dict[str, Any]:
    """The softmax section for training: overrides applied, adaptive cutoffs made explicit
    (so that a growing vocabulary keeps its clusters). A model without a softmax (original
    weights) gets a full softmax for vocabularies up to 20,000 words, else an adaptive one."""
    out = dict(raw)
    out["kind"] = kind or out.get("kind", "none")
    if out["kind"] == "none":
        out["kind"] = "full" if vocab_size <= 20000 else "adaptive"
    _check_softmax_options(out["kind"], n_samples, cutoffs)
    if n_samples is not None:
        out["n_samples"] = n_samples
    if out["kind"] == "adaptive":
        chosen = list(cutoffs or out.get("cutoffs") or default_cutoffs(vocab_size))
        chosen = [c for c in chosen if c < vocab_size - 1]
        out["cutoffs"] = chosen or list(default_cutoffs(vocab_size))
    else:
        out["cutoffs"] = list(out.get("cutoffs") or [])
    SoftmaxConfig.from_dict(out)  # validate early, naming the field
    return out


def _check_softmax_options(kind: str, n_samples: int | None, cutoffs: list[int] | None) -> None:
    """Raises for `n_samples` or `cutoffs` given to a softmax that does not read them: `kind` is
    the softmax the run trains (--softmax, else the preset's, the config's or the --init model's)."""
    if n_samples is not None and kind != "sampled":
        raise ValueError(f"--n-samples {n_samples} is read by the sampled softmax only, and this run's softmax is "
                         f"{kind}: give --softmax sampled, or leave --n-samples out")
    if cutoffs is not None and kind != "adaptive":
        raise ValueError(f"--cutoffs {','.join(map(str, cutoffs))} is read by the adaptive softmax only, and this "
                         f"run's softmax is {kind}: give --softmax adaptive, or leave --cutoffs out")


@dataclass
class TrainArgs:
    data: str
    output: str
    preset: str | None = "tiny"
    model_config: str | None = None  # a JSON file with config.json's model fields
    init: str | None = None  # native folder/URL or OPTIONS.json,WEIGHTS.hdf5
    grow_vocab: bool = True
    softmax: str | None = None  # override the config's softmax kind
    n_samples: int | None = None
    cutoffs: list[int] | None = None
    epochs: int = 1
    max_steps: int | None = None
    max_time: float | None = None  # seconds for this invocation; then checkpoint and stop
    batch_tokens: int = 4096
    max_batch_sentences: int = 512
    grad_accum: int = 1
    optimizer: str = "adagrad"
    lr: float | None = None  # adagrad 0.2, adam 1e-3
    adagrad_init: float = 1.0
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_norm: float | None = 10.0
    dropout: float = 0.1
    seed: int = 0
    checkpoint_every: int = 1000
    checkpoint_seconds: float | None = None
    keep_checkpoints: int = 3
    log_every: int = 50
    valid: str | None = None
    valid_tokenizer: str = "whitespace"
    eval_every: int = 0  # 0: only at the end
    eval_batch_tokens: int = 8192
    device: str = "auto"
    precision: str | None = None  # TRAIN_PRECISIONS; None: auto, or what `bf16` says
    bf16: str | None = None  # the older spelling (auto, on, off); folded into `precision`
    kernel: str = AUTO
    threads: int | None = None

    def __post_init__(self) -> None:
        """`precision` from either spelling; both given must agree."""
        old = None if self.bf16 is None else precision_from_bf16(self.bf16)
        if self.precision is not None and old is not None and old != self.precision:
            raise ValueError(f"--bf16 {self.bf16} and --precision {self.precision} disagree: give --precision "
                             "only (--bf16 on is --precision bf16, off is fp32, auto is auto)")
        self.precision = self.precision or old or "auto"
        self.bf16 = None
        if self.precision not in TRAIN_PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: training takes one of {TRAIN_PRECISIONS}"
                             + (" (fp16 would need loss scaling; use bf16)" if self.precision == "fp16" else ""))
        _check_ranges(self)
        self.output = local_folder(self.output, "--output", "the run folder is a local folder (checkpoints are "
                                                           "published by atomic renames, which object stores lack)")

    def to_dict(self) -> dict[str, Any]:
        """What run.json records: every field but the folded `bf16`."""
        d = asdict(self)
        d.pop("bf16")
        return d


# The options' bounds: a value outside them is refused before anything is written, since the
# loop would otherwise run zero steps and mark the run done, divide by zero, or (a negative
# clip) flip the gradients' sign.
_AT_LEAST = {"epochs": 1, "batch_tokens": 1, "max_batch_sentences": 1, "grad_accum": 1, "log_every": 1,
             "eval_batch_tokens": 1, "keep_checkpoints": 1, "n_samples": 1, "threads": 1, "max_steps": 0,
             "warmup_steps": 0, "checkpoint_every": 0, "eval_every": 0, "max_time": 0.0, "adagrad_init": 0.0,
             "weight_decay": 0.0, "clip_norm": 0.0, "min_lr_ratio": 0.0, "dropout": 0.0, "seed": 0}
_ABOVE = {"lr": 0.0, "checkpoint_seconds": 0.0}
# threads: torch.set_num_threads of 100000 kills the process; seed: see MAX_SEED
_AT_MOST = {"min_lr_ratio": 1.0, "threads": MAX_TORCH_THREADS, "seed": MAX_SEED}
_BELOW = {"dropout": 1.0}
_INTEGERS = {"epochs", "batch_tokens", "max_batch_sentences", "grad_accum", "log_every", "eval_batch_tokens",
             "keep_checkpoints", "n_samples", "threads", "max_steps", "warmup_steps", "checkpoint_every",
             "eval_every", "seed"}
SCHEDULES = ("constant", "linear", "cosine")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_ranges(args: "TrainArgs") -> None:
    """Each numeric option inside its bounds (None: not given), as a message naming the option."""
    for name in [*_AT_LEAST, *(n for n in _ABOVE if n not in _AT_LEAST)]:
        value = getattr(args, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{_option(name)}: expected a finite number, got {value!r}")
        if name in _INTEGERS and not isinstance(value, int):
            raise ValueError(f"{_option(name)}: expected an integer, got {value!r}")
        if name in _AT_LEAST and value < _AT_LEAST[name]:
            raise ValueError(f"{_option(name)} must be >= {_AT_LEAST[name]}, got {value}")
        if name in _ABOVE and value <= _ABOVE[name]:
            raise ValueError(f"{_option(name)} must be > {_ABOVE[name]}, got {value}")
        if name in _AT_MOST and value > _AT_MOST[name]:
            raise ValueError(f"{_option(name)} must be <= {_AT_MOST[name]}, got {value}")
        if name in _BELOW and value >= _BELOW[name]:
            raise ValueError(f"{_option(name)} must be < {_BELOW[name]}, got {value}")
    for name, choices in (("schedule", SCHEDULES), ("optimizer", OPTIMIZERS)):
        if getattr(args, name) not in choices:
            raise ValueError(f"{_option(name)}: expected one of {choices}, got {getattr(args, name)!r}")
    if args.cutoffs is not None:
        if any(c < 1 for c in args.cutoffs) or any(a >= b for a, b in zip(args.cutoffs, args.cutoffs[1:])):
            raise ValueError(f"--cutoffs must be positive and strictly increasing, got {args.cutoffs}")


def given_options(args: "TrainArgs") -> set[str]:
    """The fields of `args` set to something other than None and their default: what a caller of
    the library asked for (the command line knows better: see cli.training)."""
    values = {f.name: (getattr(args, f.name), f.default) for f in fields(args)}
    return {name for name, (value, default) in values.items() if value is not None and value != default}


def check_options_read(args: "TrainArgs", given: Collection[str]) -> None:
    """Raises ValueError for an option in `given` (field names) that this combination of options
    never reads: the run would go on without doing what it asks. Run before the run folder is
    made. --n-samples and --cutoffs depend on the softmax the model ends up with: build_model
    checks them (`_check_softmax_options`)."""
    unread = [
        ("eval_every", args.valid is None,
         f"--eval-every {args.eval_every} sets how often --valid is evaluated, and no --valid is given: give --valid "
         "or leave --eval-every out"),
        ("eval_batch_tokens", args.valid is None,
         f"--eval-batch-tokens {args.eval_batch_tokens} sets the batches --valid is evaluated in, and no --valid is "
         "given: give --valid or leave --eval-batch-tokens out"),
        ("grow_vocab", args.init is None,
         "--no-grow-vocab keeps the vocabulary of the --init model, and no --init is given: leave it out"),
        ("adagrad_init", args.optimizer != "adagrad",
         f"--adagrad-init {args.adagrad_init} is Adagrad's initial accumulator, and --optimizer {args.optimizer} "
         "has none: leave it out, or give --optimizer adagrad"),
        ("min_lr_ratio", args.schedule == "constant",
         f"--min-lr-ratio {args.min_lr_ratio} is where a linear or cosine schedule ends, and --schedule "
         f"{args.schedule} keeps the learning rate: give --schedule linear or cosine, or leave it out"),
        ("preset", args.init is not None,
         f"--preset {args.preset} shapes a new model, and --init {args.init} gives the model, its shape included: "
         "leave --preset out"),
        ("model_config", args.init is not None,
         f"--model-config {args.model_config} shapes a new model, and --init {args.init} gives the model, its shape "
         "included: leave --model-config out"),
        ("preset", args.model_config is not None,
         f"--preset {args.preset} and --model-config {args.model_config} both give the model's shape, and only "
         "--model-config would be used: give one of them"),
    ]
    for name, unread_here, message in unread:
        if name in given and unread_here:
            raise ValueError(message)


def run_args_as_now(recorded: dict[str, Any]) -> dict[str, Any]:
    """A run.json of any version in today's terms: earlier versions wrote `bf16`, not `precision`."""
    out = dict(recorded)
    old = out.pop("bf16", None)
    if "precision" not in out and old is not None:
        out["precision"] = precision_from_bf16(old, "run.json bf16")
    return out


class StopTraining(Exception):
    """Raised by a step hook to stop a run (tests use it to simulate a crash)."""


class TrainingDiverged(RuntimeError):
    """A non-finite gradient norm or validation perplexity: the run stops before the weights
    or anything published take the non-finite values."""


def base_lr(args: TrainArgs) -> float:
    if args.lr is not None:
        return args.lr
    return 0.2 if args.optimizer == "adagrad" else 1e-3


def lr_factor(args: TrainArgs, step: int, total: int | None) -> float:
    """Multiplier for the learning rate at optimizer step `step` (1-based)."""
    if args.warmup_steps and step <= args.warmup_steps:
        return step / args.warmup_steps
    if args.schedule == "constant" or not total:
        return 1.0
    span = max(1, total - args.warmup_steps)
    progress = min(1.0, max(0.0, (step - args.warmup_steps) / span))
    if args.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * shape


def make_scheduler(args: TrainArgs, optimizer: torch.optim.Optimizer, total: int | None,
                   steps_done: int) -> LambdaLR:
    """`lr_factor` as torch's LambdaLR, to be stepped after each optimizer step.

    LambdaLR's epoch e is the optimizer step e + 1 (its constructor applies epoch 0, the LR of
    step 1). A resumed run passes its step count: the schedule depends on nothing else, so no
    scheduler state is stored, and checkpoints written before the scheduler existed resume too."""
    for group in optimizer.param_groups:
        group["initial_lr"] = base_lr(args)  # what LambdaLR scales; a restored group's lr is the last step's
    return LambdaLR(optimizer, partial(_step_factor, args, total), last_epoch=steps_done - 1)


def _step_factor(args: TrainArgs, total: int | None, epoch: int) -> float:
    return lr_factor(args, epoch + 1, total)


# -- the model ------------------------------------------------------------------------------
def _model_spec(args: TrainArgs) -> dict[str, Any]:
    if args.model_config:
        spec = ckpt.read_json(args.model_config)
        if not isinstance(spec, dict):
            raise ConfigError(f"{args.model_config}: expected a JSON object with config.json's model fields, "
                              f"got {type(spec).__name__}")
    elif args.preset:
        if args.preset not in PRESETS:
            raise ValueError(f"unknown preset {args.preset!r}; known: {sorted(PRESETS)}")
        spec = json.loads(json.dumps(PRESETS[args.preset]))
    else:
        raise ValueError("give a preset, a model config or an init model")
    for key in ("format", "format_version", "vocab_size"):
        spec.pop(key, None)
    return spec


def _with_softmax(config: ElmoConfig, args: TrainArgs, vocab_size: int) -> ElmoConfig:
    raw = config.to_dict()
    raw["softmax"] = resolve_softmax(raw.get("softmax") or {"kind": "none"}, vocab_size, args.softmax,
                                     args.n_samples, args.cutoffs)
    raw["vocab_size"] = vocab_size
    return ElmoConfig.from_dict(raw)


def grown_vocabulary(old: Vocabulary, new: Vocabulary, key: Callable[[list[str]], list[str]] | None = None,
                     ) -> Vocabulary:
    """The old vocabulary, then the new one's tokens it lacks, in the new one's order. The new
    one's specials are left out (the old one's stand for them, under another name in another
    family), and `key` maps the new tokens to what the model looks words up by (BiLM.token_keys)."""
    have = set(old.tokens)
    keys = key(new.tokens) if key is not None else new.tokens
    extra = []
    for t, c in zip(keys, new.counts or [0] * len(new)):
        if t not in have and t not in new.specials:
            have.add(t)
            extra.append((t, c))
    counts = None
    if old.counts is not None:
        counts = [*old.counts, *(c for _, c in extra)]
    return Vocabulary([*old.tokens, *(t for t, _ in extra)], counts, old.specials)


def _copy_prefix(target: BiLM, source: dict[str, torch.Tensor]) -> list[str]:
    """Copy `source` into `target`'s state; rows along dim 0 when only the vocabulary grew."""
    state = target.state_dict()
    skipped = []
    with torch.no_grad():
        for name, value in state.items():
            if name not in source:
                skipped.append(name)
                continue
            old = source[name]
            if old.shape == value.shape:
                value.copy_(old)
            elif old.dim() == value.dim() and old.shape[1:] == value.shape[1:] and old.shape[0] <= value.shape[0]:
                value[: old.shape[0]].copy_(old)
            else:
                raise ValueError(f"cannot continue from {name!r}: shape {tuple(old.shape)} vs {tuple(value.shape)}")
    return skipped


def build_model(args: TrainArgs, corpus: PreparedCorpus, log: Callable[[str], None]) -> BiLM:
    torch.manual_seed(args.seed)  # the same initial weights in every process
    if args.init:
        source = BiLM.load(args.init)
        vocab = corpus.vocab
        if source.vocab is not None and args.grow_vocab:
            vocab = grown_vocabulary(source.vocab, corpus.vocab, source.token_keys)
        elif source.vocab is not None:
            vocab = source.vocab
        config = _with_softmax(source.config, args, len(vocab))
        if config.token_encoder != "char_cnn" and source.vocab is None:
            raise ValueError("a word-encoder model needs its vocabulary")
        model = BiLM(config, vocab, kernel=args.kernel, chars=source.chars)
        skipped = _copy_prefix(model, source.state_dict())
        grew = len(vocab) - (len(source.vocab) if source.vocab is not None else 0)
        log(f"init from {args.init}: vocabulary {len(vocab)} ({grew:+d}); new tensors: "
            f"{', '.join(skipped) if skipped else 'none'}")
        return model
    spec = _model_spec(args)
    raw = {"format": NATIVE_FORMAT, "format_version": NATIVE_FORMAT_VERSION, **spec, "vocab_size": len(corpus.vocab)}
    raw["softmax"] = resolve_softmax(spec.get("softmax") or {"kind": "none"}, len(corpus.vocab), args.softmax,
                                     args.n_samples, args.cutoffs)
    config = ElmoConfig.from_dict(raw, where=args.model_config or f"preset {args.preset!r}")
    return BiLM(config, corpus.vocab, kernel=args.kernel)


def make_optimizer(args: TrainArgs, model: nn.Module) -> torch.optim.Optimizer:
    if args.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}")
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=base_lr(args), initial_accumulator_value=args.adagrad_init,
                                   weight_decay=args.weight_decay)
    return torch.optim.Adam(params, lr=base_lr(args), weight_decay=args.weight_decay)


# -- metrics --------------------------------------------------------------------------------
CSV_FIELDS = ["kind", "step", "epoch", "elapsed_s", "tokens", "tokens_per_s", "loss", "perplexity",
              "forward_perplexity", "backward_perplexity", "lr", "grad_norm", "peak_memory_gib"]


class MetricsLog:
    def __init__(self, path: str, enabled: bool, resume_step: int | None) -> None:
        self.path = path
        self.enabled = enabled
        if not enabled:
            return
        rows = []
        if resume_step is not None and os.path.exists(path):  # drop rows the resumed run redoes
            with open(path, newline="", encoding="utf-8") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, CSV_FIELDS).writerow({k: row.get(k, "") for k in CSV_FIELDS})


def _fmt_time(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


# -- the loop's state -----------------------------------------------------------------------
@dataclass
class RunState:
    """What a checkpoint's trainer_state.json holds: where the run is."""
    step: int = 0
    position: Position = field(default_factory=Position)
    tokens: int = 0
    elapsed: float = 0.0
    best_valid: float | None = None
    best_step: int | None = None
    done: bool = False
    finished_under: list | None = None  # [epochs, max_steps] of the command that finished it
    # the sums of the steps since the last log line (Window, over every process), so that a
    # resumed run writes the log line an unbroken one would have
    window: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["position"] = self.position.to_dict()
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RunState":
        return cls(int(raw["step"]), Position.from_dict(raw["position"]), int(raw["tokens"]),
                   float(raw["elapsed"]), raw.get("best_valid"), raw.get("best_step"), bool(raw.get("done", False)),
                   raw.get("finished_under"), raw.get("window"))

    def result(self) -> dict[str, Any]:
        """`pretrain`'s answer."""
        return {"step": self.step, "done": self.done, "tokens": self.tokens, "best_valid": self.best_valid,
                "best_step": self.best_step, "elapsed_s": self.elapsed}


@dataclass
class Window:
    """Sums over this process's optimizer steps since the last log line."""
    fwd_nll: float = 0.0
    bwd_nll: float = 0.0
    predictions: int = 0
    words: int = 0
    grad_norm: float = 0.0
    steps: int = 0
    lr: float = 0.0  # the last step's
    started: float = field(default_factory=time.perf_counter)


def _window_totals(ctx: DistContext, window: Window) -> dict[str, Any]:
    """`window` summed over the processes, as a checkpoint keeps it (a collective call)."""
    fwd, bwd, n, words = ctx.sum([window.fwd_nll, window.bwd_nll, float(window.predictions), float(window.words)])
    return {"fwd_nll": fwd, "bwd_nll": bwd, "predictions": int(n), "words": int(words),
            "grad_norm": window.grad_norm, "steps": window.steps, "lr": window.lr,
            "seconds": time.perf_counter() - window.started}


def _carried_window(saved: dict | None, main: bool) -> Window:
    """The Window a resumed run goes on with: the sums in the main process only, since the log
    line sums them over the processes; the gradient norms (the same in every process) in each."""
    if not saved:
        return Window()
    share = 1 if main else 0
    return Window(fwd_nll=saved["fwd_nll"] * share, bwd_nll=saved["bwd_nll"] * share,
                  predictions=saved["predictions"] * share, words=saved["words"] * share,
                  grad_norm=saved["grad_norm"], steps=saved["steps"], lr=saved["lr"],
                  started=time.perf_counter() - saved["seconds"])


Micro = tuple[list[list[str]], list[Any], Position]  # a micro-batch as BatchStream yields it


@dataclass
class Session:
    """One invocation of `pretrain`: what `Trainer._setup` builds and the loop works with."""
    ctx: DistContext
    model: BiLM
    objective: nn.Module  # LmObjective, DDP-wrapped with several processes
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    stream: BatchStream
    metrics: MetricsLog
    state: RunState
    total_steps: int | None  # known for --max-steps and for a decaying schedule
    same_vocab: bool  # the prepared ids are the model's: no lookup per batch
    precision: str  # fp32 or bf16, as training_precision resolved it for this device
    autocast: ContextManager  # reentered for every micro-batch: products in `precision`, the rest float32
    params: list[nn.Parameter]
    started: float = field(default_factory=time.perf_counter)
    elapsed_before: float = 0.0  # the run's time in earlier invocations
    last_checkpoint: float = field(default_factory=time.perf_counter)
    pending_words: int = 0  # this process's words not yet added to state.tokens
    window: Window = field(default_factory=Window)
    stopped_for_time: bool = False


def _write_best(model: BiLM, result: dict[str, Any], folder: str) -> None:
    model.save_pretrained(folder)
    with open(os.path.join(folder, "valid.json"), "w", encoding="utf-8") as f:
        f.write(dumps_strict(result, f"{folder}/valid.json", indent=2))


# -- the trainer ----------------------------------------------------------------------------
class Trainer:
    def __init__(self, args: TrainArgs, ctx: DistContext | None = None,
                 step_hook: Callable[[int], None] | None = None, out: TextIO | None = None) -> None:
        self.args = args
        self.ctx = ctx
        self.step_hook = step_hook
        self.out = out or sys.stderr
        self.model_dir = os.path.join(args.output, "model")
        self.best_dir = os.path.join(args.output, "best")

    def log(self, message: str) -> None:
        if self.ctx is None or self.ctx.is_main:
            tqdm.write(message, file=self.out)  # above the progress bar, which redraws below it
            self.out.flush()

    def run(self) -> dict[str, Any]:
        args = self.args
        _check_ranges(args)  # again: a TrainArgs may have been changed since it was made
        check_options_read(args, given_options(args))
        if args.threads:
            torch.set_num_threads(args.threads)
        own_ctx = self.ctx is None
        ctx = self.ctx = self.ctx or init_distributed(args.device)
        try:
            return self._run(ctx)
        finally:
            if own_ctx:
                ctx.close()

    def _run(self, ctx: DistContext) -> dict[str, Any]:
        corpus = self._check_inputs()
        # A new run's model is built before anything is written: a bad config leaves no run behind.
        fresh = None if ckpt.latest_checkpoint(self.args.output) else build_model(self.args, corpus, self.log)
        with self._claim_run(ctx):
            resume = ckpt.latest_checkpoint(self.args.output)
            model, state = self._model_and_state(corpus, resume, fresh)
            if state.done and state.finished_under == [self.args.epochs, self.args.max_steps]:
                return self._already_finished(ctx, model, state, resume)
            session = self._setup(ctx, corpus, model, state, resume)
            self._train(session)
            return self._finish(session)

    # -- setup ----------------------------------------------------------------------------------
    def _check_inputs(self) -> PreparedCorpus:
        """The corpus, the output folder and the held-out data, checked before anything is
        written: a wrong --data or --valid found after training would cost the training."""
        args = self.args
        check_output_folder(args.output)
        corpus = PreparedCorpus(args.data)
        if corpus.manifest.tokens == 0:
            raise ValueError(f"--data {args.data}: the prepared corpus holds no tokens; there is nothing to train on")
        if args.valid:
            check_sentences(args.valid, args.valid_tokenizer, "--valid")
        return corpus

    @contextlib.contextmanager
    def _claim_run(self, ctx: DistContext) -> Iterator[None]:
        """The run folder, held by this run alone, as the last run left it (tidied), with run.json."""
        os.makedirs(self.args.output, exist_ok=True)
        with ckpt.run_lock(self.args.output) if ctx.is_main else contextlib.nullcontext():
            if ctx.is_main:
                ckpt.remove_temporaries(self.args.output)
                recover_folder(self.model_dir)
                recover_folder(self.best_dir)
                self._save_run_args()
            ctx.barrier()
            yield

    def _save_run_args(self) -> None:
        path = os.path.join(self.args.output, "run.json")
        current = self.args.to_dict()
        if os.path.exists(path):
            recorded = ckpt.read_json(path)
            if not isinstance(recorded, dict):
                raise ValueError(f"{path}: expected a JSON object (the run's first command)")
            first = run_args_as_now(recorded)
            changed = sorted(k for k in current if first.get(k) != current[k])
            if changed:
                self.log(f"note: arguments differ from the run's first command: {', '.join(changed)}")
            if "precision" not in recorded and first.get("precision") == "bf16" and self.ctx.device.type != "cuda":
                self.log(f"note: the version that started this run trained in fp32 on {self.ctx.device.type} "
                         "(its --bf16 was for CUDA only); the steps from here run in bf16")
            return
        write_url_atomically(path, dumps_strict(current, path, indent=2, sort_keys=True).encode("utf-8"))

    def _model_and_state(self, corpus: PreparedCorpus, resume: str | None, fresh: BiLM | None,
                         ) -> tuple[BiLM, RunState]:
        if resume is None:
            return fresh or build_model(self.args, corpus, self.log), RunState()
        with ckpt.reading_checkpoint(resume):
            model = ckpt.load_checkpoint_model(resume)
            state = RunState.from_dict(ckpt.load_trainer_state(resume))
        # out here: the checkpoint is fine, and an error in it would say it cannot be read
        model.kernel = check_kernel(self.args.kernel, model.config.lstm)
        self.log(f"resuming from {resume} (step {state.step})")
        return model, state

    def _already_finished(self, ctx: DistContext, model: BiLM, state: RunState, resume: str | None,
                          ) -> dict[str, Any]:
        if ctx.is_main and not os.path.isdir(self.model_dir):  # a run finished by a version that wrote it last
            replace_folder(self.model_dir, model.save_pretrained)
            self.log(f"model/ was missing: written from {resume}")
        self.log("this run has already finished; nothing to do")
        return state.result()

    def _setup(self, ctx: DistContext, corpus: PreparedCorpus, model: BiLM, state: RunState,
               resume: str | None) -> Session:
        args, device = self.args, ctx.device
        state.done = False
        model.to(device)
        model.train()
        objective = _objective(ctx, model)
        optimizer = make_optimizer(args, model)
        if resume:
            with ckpt.reading_checkpoint(resume):
                ckpt.restore_optimizer(resume, optimizer, device)
                ckpt.restore_rng(resume, ctx.rank)
        else:
            torch.manual_seed(args.seed * 1000003 + 17 + ctx.rank)  # dropout and sampling streams
        stream = BatchStream(corpus, seed=args.seed, batch_tokens=args.batch_tokens,
                             max_sentences=args.max_batch_sentences, rank=ctx.rank, world_size=ctx.world_size)
        total_steps = args.max_steps
        if total_steps is None and args.schedule != "constant":
            total_steps = math.ceil(stream.batches_per_epoch() * args.epochs / args.grad_accum)
        precision = training_precision(args.precision, device)
        metrics = MetricsLog(os.path.join(args.output, "metrics.csv"), ctx.is_main, state.step if resume else None)
        self.log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocabulary "
                 f"{len(model.vocab or [])}, softmax {model.config.softmax.kind}; corpus "
                 f"{corpus.manifest.tokens:,} tokens in {corpus.n_shards} shard(s); {ctx.world_size} process(es) "
                 f"on {device}, {precision}")
        return Session(
            ctx=ctx, model=model, objective=objective, optimizer=optimizer,
            scheduler=make_scheduler(args, optimizer, total_steps, state.step), stream=stream, metrics=metrics,
            state=state, total_steps=total_steps, same_vocab=vocab_digest(model.vocab) == vocab_digest(corpus.vocab),
            precision=precision, autocast=autocast(device, precision),
            params=[p for p in model.parameters() if p.requires_grad], elapsed_before=state.elapsed,
            window=_carried_window(state.window if resume else None, ctx.is_main))

    # -- the loop -------------------------------------------------------------------------------
    def _train(self, s: Session) -> None:
        """Optimizer steps until --max-steps, the end of --epochs or --max-time."""
        args = self.args
        batches = s.stream.iterate(s.state.position, args.epochs)
        with progress_bar("pretrain", total=s.total_steps, unit="steps", enabled=s.ctx.is_main,
                          initial=s.state.step) as bar:
            exhausted = False
            while not exhausted and (args.max_steps is None or s.state.step < args.max_steps):
                micro, exhausted = self._next_micro_batches(batches)
                if not micro:
                    break
                note_tokens(bar, 1, self._train_step(s, micro))
                if self._after_step(s):
                    s.stopped_for_time = True
                    break

    def _next_micro_batches(self, batches: Iterator[Micro]) -> tuple[list[Micro], bool]:
        """Up to --grad-accum micro-batches, and whether the data ended."""
        micro: list[Micro] = []
        for _ in range(self.args.grad_accum):
            try:
                micro.append(next(batches))
            except StopIteration:
                return micro, True
        return micro, False

    def _train_step(self, s: Session, micro: list[Micro]) -> int:
        """One optimizer step over the micro-batches (their mean loss); the words it trained on."""
        args, ctx, window = self.args, s.ctx, s.window
        s.optimizer.zero_grad(set_to_none=True)
        words = 0
        for k, (sentences, ids, _) in enumerate(micro):
            batch = make_batch(s.model, sentences, ids if s.same_vocab else None).to(ctx.device)
            sync = k == len(micro) - 1 or not ctx.enabled  # DDP reduces gradients after the last one only
            with contextlib.nullcontext() if sync else s.objective.no_sync(), s.autocast:
                f, b, n = run_objective(s.objective, batch, args.dropout)
                loss = (f + b) / (2 * n) / len(micro)
            loss.backward()
            window.fwd_nll += float(f.detach())
            window.bwd_nll += float(b.detach())
            window.predictions += n
            words += batch.n_words
        window.lr = s.scheduler.get_last_lr()[0]
        norm = _clip_gradients(s.params, args.clip_norm)
        if not math.isfinite(norm):  # the same in every process: the norm is of the reduced gradients
            raise TrainingDiverged(self._divergence(s, norm))
        window.grad_norm += norm
        s.optimizer.step()
        s.scheduler.step()
        s.state.step += 1
        s.state.position = micro[-1][2]
        window.words += words
        window.steps += 1
        s.pending_words += words
        return words

    def _divergence(self, s: Session, norm: float) -> str:
        return (f"training diverged at step {s.state.step + 1}: the gradient norm is {norm} at learning rate "
                f"{s.window.lr:.4g}; that step was not applied and the run stops, not done and without "
                f"model/. {self._what_to_do()}")

    def _what_to_do(self) -> str:
        last = ckpt.latest_checkpoint(self.args.output)
        then = (f"the last checkpoint, {last}, is where the same command resumes" if last else
                "no checkpoint was written, so the same command starts again")
        return f"Lower --lr or --clip-norm, or add --warmup-steps; {then}"

    def _check_finite_weights(self, s: Session) -> None:
        bad = next((name for name, p in s.model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None:  # the same weights in every process (DDP keeps them equal)
            raise TrainingDiverged(f"training diverged by step {s.state.step}: parameter {bad!r} holds NaN or "
                                   f"infinite values; nothing of it is published. {self._what_to_do()}")

    def _after_step(self, s: Session) -> bool:
        """Logging, validation and checkpoints due after a step; True when --max-time is up."""
        args, state = self.args, s.state
        now = time.perf_counter()
        state.elapsed = s.elapsed_before + (now - s.started)
        if self.step_hook is not None:
            self.step_hook(state.step)
        if state.step % args.log_every == 0:
            self._flush_tokens(s)
            self._log_window(s)
        if args.eval_every and state.step % args.eval_every == 0:
            self._validate(s)
        if self._checkpoint_due(s, now):
            self._flush_tokens(s)
            self._check_finite_weights(s)  # a step's finite gradients can still take a weight past float32
            self._save(s)
            s.last_checkpoint = time.perf_counter()
        return args.max_time is not None and _any_process(s.ctx, now - s.started >= args.max_time)

    def _checkpoint_due(self, s: Session, now: float) -> bool:
        args = self.args
        due = s.state.step % args.checkpoint_every == 0 if args.checkpoint_every else False
        if args.checkpoint_seconds is not None:
            due = _any_process(s.ctx, now - s.last_checkpoint >= args.checkpoint_seconds) or due
        return due

    def _finish(self, s: Session) -> dict[str, Any]:
        """The last log line and validation, model/, the final checkpoint."""
        args, ctx, state = self.args, s.ctx, s.state
        if s.window.steps:
            self._flush_tokens(s)
            self._log_window(s)
        finished = not s.stopped_for_time
        if args.valid and state.step and not (args.eval_every and state.step % args.eval_every == 0):
            self._validate(s)  # also when stopped for time: best/ then always reflects the last weights too
        state.done = finished
        state.finished_under = [args.epochs, args.max_steps] if finished else None
        self._flush_tokens(s)
        self._check_finite_weights(s)  # before model/ and the final checkpoint
        if finished and ctx.is_main:
            # model/ before the checkpoint that marks the run done: killed in between, the run is
            # not done, and the same command redoes the steps after its last checkpoint and this.
            replace_folder(self.model_dir, s.model.save_pretrained)
        existing = ckpt.latest_checkpoint(args.output)
        if existing is None or not existing.endswith(ckpt.checkpoint_name(state.step)) or finished:
            self._save(s, final=finished)
        if finished:
            self.log(f"finished: {state.step} steps, {state.tokens:,} tokens, model in {self.model_dir}")
        else:
            self.log(f"stopped at the time limit after step {state.step}; run the same command to continue")
        return state.result()

    # -- validation, checkpoints, logging ---------------------------------------------------------
    def _validate(self, s: Session) -> None:
        """Held-out perplexity; an improvement is published to best/."""
        args, state = self.args, s.state
        if not args.valid:
            return
        try:
            result = evaluate_sentences(s.model, data_sentences(s.model, args.valid, args.valid_tokenizer),
                                        args.eval_batch_tokens, s.ctx.device, s.precision)
        except NonFinitePerplexity as exc:
            raise TrainingDiverged(f"validation at step {state.step}: {exc}; the run stops here, not done. "
                                   f"{self._what_to_do()}") from exc
        ppl = result["average_perplexity"]
        improved = state.best_valid is None or ppl < state.best_valid
        self.log(f"valid step {state.step}: perplexity {ppl:.2f} (forward {result['forward_perplexity']:.2f}, "
                 f"backward {result['backward_perplexity']:.2f}){' *best*' if improved else ''}")
        s.metrics.write({"kind": "valid", "step": state.step, "epoch": state.position.epoch,
                         "elapsed_s": round(state.elapsed, 1), "tokens": state.tokens,
                         "loss": round(0.5 * (result["forward_nll"] + result["backward_nll"]), 5),
                         "perplexity": round(ppl, 3), "forward_perplexity": round(result["forward_perplexity"], 3),
                         "backward_perplexity": round(result["backward_perplexity"], 3)})
        if improved:
            state.best_valid, state.best_step = ppl, state.step
            if s.ctx.is_main:
                replace_folder(self.best_dir, partial(_write_best, s.model, {**result, "step": state.step}))

    def _save(self, s: Session, final: bool = False) -> None:
        """A checkpoint of this step: every process writes its random state, the main one the rest."""
        args, ctx, step = self.args, s.ctx, s.state.step
        s.state.window = _window_totals(ctx, s.window)
        tmp = ckpt.begin_checkpoint(args.output, step) if ctx.is_main else None
        ctx.barrier()
        ckpt.write_rng(tmp or ckpt.temporary_dir(args.output, step), ctx.rank)
        ctx.barrier()
        if tmp is not None:
            path = ckpt.finish_checkpoint(args.output, step, tmp, s.model, s.optimizer, s.state.to_dict(),
                                          args.keep_checkpoints)
            self.log(f"checkpoint {path}{' (final)' if final else ''}")
        ctx.barrier()

    def _flush_tokens(self, s: Session) -> None:
        s.state.tokens += int(s.ctx.sum([float(s.pending_words)])[0])
        s.pending_words = 0

    def _log_window(self, s: Session) -> None:
        """The log line and metrics row of the steps since the last one, summed over processes."""
        window, state = s.window, s.state
        fwd, bwd, n, words = s.ctx.sum([window.fwd_nll, window.bwd_nll, float(window.predictions),
                                        float(window.words)])
        seconds = max(1e-9, time.perf_counter() - window.started)
        if n:
            fnll, bnll = fwd / n, bwd / n
            loss = 0.5 * (fnll + bnll)
            rate = words / seconds
            gnorm = window.grad_norm / max(1, window.steps)
            # this process's peak since it started (CUDA only: the allocator's own count, no sync)
            peak = torch.cuda.max_memory_allocated(s.ctx.device) / 2**30 if s.ctx.device.type == "cuda" else None
            # a sampled softmax's loss is over the sampled candidates only: its exp is no perplexity
            # (many times lower than the full softmax's); the valid rows give that one
            sampled = s.model.config.softmax.kind == "sampled"
            ppl = "" if sampled else (f" | perplexity {math.exp(loss):.2f} (forward {math.exp(fnll):.2f}, "
                                      f"backward {math.exp(bnll):.2f})")
            self.log(f"step {state.step} | epoch {state.position.epoch} | {rate:,.0f} tokens/s | "
                     f"{'sampled loss' if sampled else 'loss'} {loss:.4f}{ppl}"
                     f" | lr {window.lr:.4g} | grad norm {gnorm:.3f}"
                     + (f" | peak {peak:.1f} GiB" if peak is not None else "") + f" | {_fmt_time(state.elapsed)}")
            s.metrics.write({"kind": "train", "step": state.step, "epoch": state.position.epoch,
                             "elapsed_s": round(state.elapsed, 1), "tokens": state.tokens,
                             "tokens_per_s": round(rate, 1), "loss": round(loss, 5),
                             **({} if sampled else {
                                 "perplexity": round(math.exp(loss), 3),
                                 "forward_perplexity": round(math.exp(fnll), 3),
                                 "backward_perplexity": round(math.exp(bnll), 3)}),
                             "lr": window.lr, "grad_norm": round(gnorm, 4),
                             "peak_memory_gib": "" if peak is None else round(peak, 2)})
        s.window = Window()


def _objective(ctx: DistContext, model: BiLM) -> nn.Module:
    objective = LmObjective(model)
    if not ctx.enabled:
        return objective
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(objective, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               find_unused_parameters=True)


def _clip_gradients(params: list[nn.Parameter], clip_norm: float | None) -> float:
    """The global gradient norm before clipping (clipped to `clip_norm` when given)."""
    if clip_norm:
        return float(torch.nn.utils.clip_grad_norm_(params, clip_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params
                                                       if p.grad is not None])))


def _any_process(ctx: DistContext, flag: bool) -> bool:
    """`flag` of any process, so that all of them take the same branch (a collective with several)."""
    return ctx.max(float(flag)) > 0 if ctx.enabled else flag


def train(args: TrainArgs, **kwargs: Any) -> dict[str, Any]:
    return Trainer(args, **kwargs).run()
