"""A config checked against the tensors a weight file holds, before the model is allocated.

A config.json or options.json that says lstm.dim 4000000 beside unchanged tensors would
otherwise allocate tens of GB before the first tensor is compared. Every refusal names the
tensor, the config field and its file.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from elmo_pipeline.formats.files import CheckpointError
from elmo_pipeline.model.config import ElmoConfig
from elmo_pipeline.model.vocabulary import CharVocabulary, Vocabulary
from elmo_pipeline.strict import shown

# The float types a weight file's tensors may have: those torch computes with everywhere (float8
# has no isfinite, so a float8 file is refused by name here rather than by torch later).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# The fills that the constructors of torch's layers and ours call on their parameters.
_FILLS: frozenset[Callable[..., Any]] = frozenset(
    (nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.zeros_, nn.init.ones_, nn.init.constant_))


class _SkipFillsOfMetaTensors(TorchFunctionMode):
    """A torch.nn.init fill given a meta tensor returns it as it is; every other call runs."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if func in _FILLS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Modules built inside are on the meta device and their parameters are not filled: for their
    shapes and counts. torch fills a meta tensor with `normal_` (nn.Embedding's constructor does)
    through Python meta kernels, and the first such call imported some 830 modules of torch (its
    meta registrations, decompositions, dynamo): 1 to 2 s of CPU at every model load in a new
    process, each command's and each worker's, for values a meta tensor does not hold. The mode
    is the calling thread's alone."""
    with torch.device("meta"), _SkipFillsOfMetaTensors():
        yield


class Dim(NamedTuple):
    """One axis of a tensor the config asks for: its size and the config field that sets it
    (with its value, "lstm.dim=4096"; empty for a fixed size)."""

    size: int
    field: str = ""


def shape_error(where: str, name: str, actual: tuple[int, ...], dims: Sequence[Dim], config_where: str) -> CheckpointError:
    needed = tuple(d.size for d in dims)
    if len(actual) == len(dims):
        wrong = [d for d, a in zip(dims, actual) if d.size != a]
        fixed = [i for i, (d, a) in enumerate(zip(dims, actual)) if d.size != a and not d.field]
    else:
        wrong, fixed = list(dims), []
    fields = list(dict.fromkeys(d.field for d in wrong if d.field))
    if not fields and not fixed:
        fields = list(dict.fromkeys(d.field for d in dims if d.field))
    who = f"{' and '.join(fields)} in {config_where}" if fields else config_where
    # an axis no config field sets (the byte alphabet's rows, the two directions) is not blamed on one
    fixed_note = "".join(f"; axis {i} has a fixed size, {dims[i].size}" for i in fixed)
    return CheckpointError(f"{where}: tensor {name!r} has shape {actual}, but {who} needs {needed}{fixed_note}")


def _native_dims(name: str, shape: tuple[int, ...], config: ElmoConfig) -> tuple[Dim, ...]:
    """The model's tensor `name` of `shape`, each axis with the config field that sets it."""
    lstm, cnn = config.lstm, config.char_cnn
    p, h = f"lstm.projection_dim={lstm.projection_dim}", f"lstm.dim={lstm.dim}"
    v, w = f"vocab_size={config.vocab_size}", f"word_embedding_dim={config.word_embedding_dim}"
    n_filters = "" if cnn is None else f"char_cnn.filters (counts summing to {cnn.n_filters})"
    parts = name.split(".")
    fields: tuple[str, ...] = ()
    if parts[0] == "lstm":  # lstm.layers.I.input_weight (2, 4H, P), recurrent_weight, bias (2, 4H), projection (2, P, H)
        fields = {"input_weight": ("", h, p), "recurrent_weight": ("", h, p), "bias": ("", h),
                  "projection": ("", p, h)}.get(parts[-1], ())
    elif parts[:2] == ["token_encoder", "char_cnn"] and cnn is not None:
        embedding = f"char_cnn.embedding.dim={cnn.embedding_dim}"
        if parts[2] == "char_embedding":
            size = config.char_dictionary and f"char_dictionary.size={config.char_dictionary.size}"
            fields = (size or "", embedding)
        elif parts[2] == "convs":
            k = int(parts[3])
            filters = f"char_cnn.filters[{k}]={list(cnn.filters[k]) if k < len(cnn.filters) else None}"
            fields = (filters, embedding, filters) if parts[-1] == "weight" else (filters,)
        elif parts[2] == "highways":
            fields = (n_filters, n_filters)
    elif parts[:2] == ["token_encoder", "word_embedding"]:
        fields = (v, w)
    elif parts[:2] == ["token_encoder", "projection"]:
        inputs = " + ".join(f for f, used in ((n_filters, cnn is not None), (w, config.word_embedding_dim)) if used)
        fields = (p, inputs)
    elif parts[0] == "softmax":
        if parts[1] == "adaptive":
            fields = (f"softmax.cutoffs={shown(list(config.softmax.cutoffs))}, softmax.div_value={config.softmax.div_value}, "
                      f"{v} and {p}",) * len(shape)
        else:
            fields = (v, p)
    return tuple(Dim(size, fields[i] if i < len(fields) else "") for i, size in enumerate(shape))


def _present_count(names: Iterable[str], prefix: str) -> int:
    """How many consecutive blocks `prefix`0., `prefix`1., ... `names` holds."""
    indices = {int(n[len(prefix):].split(".", 1)[0]) for n in names
               if n.startswith(prefix) and n[len(prefix):].split(".", 1)[0].isdigit()}
    count = 0
    while count in indices:
        count += 1
    return count


def check_counts(names: Iterable[str], counted: Sequence[tuple[str, str, int]], where: str, config_where: str) -> None:
    """Each numbered group `prefix`N.* present as often as the config field says (prefix, field,
    wanted); checked first, as a count of a million would build a million modules."""
    names = list(names)
    for prefix, field, wanted in counted:
        present = _present_count(names, prefix)
        if wanted != present:
            raise CheckpointError(f"{where}: holds {present} of the numbered tensor groups '{prefix}N.*', "
                                  f"but {field}={wanted} in {config_where} needs {wanted}")


def check_tensors(shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], where: str,
                  config_where: str, dims: Callable[[str, tuple[int, ...]], Sequence[Dim]]) -> None:
    """Exactly the tensors of `expected` (name -> shape, in the order problems are named), of
    those shapes; `dims(name, shape)` names the config field of each axis for the message."""
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckpointError(f"{where}: tensor {name!r} is missing ({len(set(expected) - set(shapes))} missing "
                                  f"in all); {config_where} asks for it")
        if tuple(shapes[name]) != tuple(shape):
            raise shape_error(where, name, tuple(shapes[name]), dims(name, shape), config_where)
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); "
                              f"{config_where} does not ask for it")


def check_config_against_shapes(
    model_class: type[nn.Module], config: ElmoConfig, vocab: Vocabulary | None, shapes: Mapping[str, tuple[int, ...]], where: str, config_where: str,
    chars: CharVocabulary | None = None,
) -> None:
    """Refuse, naming the config field and the tensor, a config whose model does not have
    exactly the tensors `shapes` (name -> shape) describes; nothing of the model's size is
    allocated (the model is built on the meta device)."""
    counted = [("lstm.layers.", "lstm.n_layers", config.lstm.n_layers)]
    if config.char_cnn is not None:
        counted += [("token_encoder.char_cnn.highways.", "char_cnn.n_highway", config.char_cnn.n_highway),
                    ("token_encoder.char_cnn.convs.", "char_cnn.filters (one convolution each)",
                     len(config.char_cnn.filters))]
    if config.softmax.kind == "adaptive" and config.softmax.cutoffs:  # none: the defaults, at most 4 clusters
        # a cluster a cutoff, each a module: 100,000 took 30 s and 1.4 GB to build
        counted.append(("softmax.adaptive.tail.", "softmax.cutoffs (one tail cluster each)",
                        len(config.softmax.cutoffs)))
    check_counts(shapes, counted, where, config_where)
    try:
        with shapes_only():
            model = model_class(config, vocab, cache_size=0, chars=chars)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:  # a size torch cannot address or take
        raise CheckpointError(f"{config_where}: describes a model that cannot be built ({first_line(exc)})") from exc
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    # the model's order: the first problem named is the first in the model
    check_tensors(shapes, expected, where, config_where, lambda name, shape: _native_dims(name, shape, config))


def load_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all)")
    for name in expected:  # the model's own order, so the first problem named is the first in the model
        value = state[name]
        if tuple(value.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(value.shape)}, the config needs {tuple(expected[name].shape)}")
        check_values(value, name, where)
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


def check_values(value: torch.Tensor, name: str, where: str) -> None:
    """A dense tensor that holds values (not sparse, not on the meta device), of one of
    FLOAT_DTYPES, and finite, also as the float32 our models hold; refused naming the file and
    the tensor."""
    if value.layout != torch.strided:
        raise CheckpointError(f"{where}: tensor {name!r} has layout {value.layout}, expected a dense tensor")
    if value.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {value.dtype}, expected floating point "
                              "(float16, bfloat16, float32 or float64)")
    if value.device.type == "meta":
        raise CheckpointError(f"{where}: tensor {name!r} is a meta tensor, which holds no values")
    if not torch.isfinite(value).all():
        raise CheckpointError(f"{where}: tensor {name!r} holds NaN or infinite values")
    if value.dtype == torch.float64 and value.numel() and value.abs().max() > torch.finfo(torch.float32).max:
        raise CheckpointError(f"{where}: tensor {name!r} holds values beyond float32's range, which would be "
                              "infinite in the model")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (torch's run to pages), or its type without one."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
