"""`pretrain`'s options: TrainArgs, their bounds, and the options a run would not read.

Everything here is checked before the run folder is touched: a value out of its bounds would
have the loop run zero steps and mark the run done, divide by zero, or flip the gradients' sign,
and an option that this combination never reads would be ignored without a word. The older
`bf16` option is folded into `precision` here, for command lines and for the run.json files of
earlier versions alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Collection

import torch

from elmo_pipeline.filesystems import local_folder, without_userinfo
from elmo_pipeline.formats.files import model_shown
from elmo_pipeline.runtime import check_precision
from elmo_pipeline.runtime_choices import AUTO, FLOAT32_MAX, MAX_SEED, MAX_TORCH_THREADS, TRAIN_PRECISIONS

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
        check_ranges(self)
        self.output = local_folder(self.output, "--output", "the run folder is a local folder (checkpoints are "
                                                           "published by atomic renames, which object stores lack)")

    def to_dict(self) -> dict[str, Any]:
        """What run.json records: every field but the folded `bf16`, `init` as outputs record a
        model (model_shown: a URL without the password or token that opened it), and `data` and
        `valid` as outputs record an input (without_userinfo: a URL without its password)."""
        d = asdict(self)
        d.pop("bf16")
        return _locations_shown(d)


# The options' bounds: a value outside them is refused before anything is written, since the
# loop would otherwise run zero steps and mark the run done, divide by zero, or (a negative
# clip) flip the gradients' sign.
_AT_LEAST = {"epochs": 1, "batch_tokens": 1, "max_batch_sentences": 1, "grad_accum": 1, "log_every": 1,
             "eval_batch_tokens": 1, "keep_checkpoints": 1, "n_samples": 1, "threads": 1, "max_steps": 0,
             "warmup_steps": 0, "checkpoint_every": 0, "eval_every": 0, "max_time": 0.0, "adagrad_init": 0.0,
             "weight_decay": 0.0, "clip_norm": 0.0, "min_lr_ratio": 0.0, "dropout": 0.0, "seed": 0}
_ABOVE = {"lr": 0.0, "checkpoint_seconds": 0.0}
# threads: torch.set_num_threads of 100000 kills the process; seed: see MAX_SEED; the optimizer's
# float32 state takes lr, weight decay and Adagrad's initial value: past float32, torch failed at
# the first step naming no option
_AT_MOST = {"min_lr_ratio": 1.0, "threads": MAX_TORCH_THREADS, "seed": MAX_SEED, "lr": FLOAT32_MAX,
            "weight_decay": FLOAT32_MAX, "adagrad_init": FLOAT32_MAX}
_BELOW = {"dropout": 1.0}
_INTEGERS = {"epochs", "batch_tokens", "max_batch_sentences", "grad_accum", "log_every", "eval_batch_tokens",
             "keep_checkpoints", "n_samples", "threads", "max_steps", "warmup_steps", "checkpoint_every",
             "eval_every", "seed"}
SCHEDULES = ("constant", "linear", "cosine")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_ranges(args: "TrainArgs") -> None:
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


# the options that name something, and what to give instead of an empty value
_NAMING = {"data": "data; give the folder `prepare` wrote",
           "valid": "data; give a prepared folder or a text glob, or leave it out",
           "init": "model; give a model folder or URL, or OPTIONS.json,WEIGHTS.hdf5, or leave it out",
           "model_config": "file; give a JSON file of config.json's model fields, or leave it out",
           "preset": "preset; give its name, or leave it out"}


def check_options_read(args: "TrainArgs", given: Collection[str]) -> None:
    """Raises ValueError for an option in `given` (field names) that this combination of options
    never reads: the run would go on without doing what it asks. Run before the run folder is
    made. --n-samples and --cutoffs depend on the softmax the model ends up with: build_model
    checks them (`_check_softmax_options`)."""
    # an unset variable: --valid '' was taken for none (nothing validated); the others were refused
    # for something else ("give a preset, a model config or an init model" for --model-config '')
    for name, what in _NAMING.items():
        value = getattr(args, name)
        if value is not None and not str(value).strip():
            raise ValueError(f"{_option(name)} {value!r} names no {what}")
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


def _locations_shown(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with `init`, `data` and `valid` as run.json records them (see TrainArgs.to_dict)."""
    for key, shown in (("init", model_shown), ("data", without_userinfo), ("valid", without_userinfo)):
        if isinstance(d.get(key), str):
            d[key] = shown(d[key])
    return d


def run_args_as_now(recorded: dict[str, Any]) -> dict[str, Any]:
    """A run.json of any version in today's terms: earlier versions wrote `bf16`, not `precision`,
    and `init`, `data` and `valid` as given (a resume on the same URLs was told that they differ)."""
    out = _locations_shown(dict(recorded))
    old = out.pop("bf16", None)
    if "precision" not in out and old is not None:
        out["precision"] = precision_from_bf16(old, "run.json bf16")
    return out
