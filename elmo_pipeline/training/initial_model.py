"""The model a new run starts from: a preset or a --model-config shape, or an --init model
(native, or original weights without a softmax) whose vocabulary grows with the corpus's new
words and whose weights are copied into the larger tensors (a new word's embedding row starts as
the unknown word's, the softmax's new rows as initialised).

The softmax is resolved here, not with the other options: which of --n-samples and --cutoffs a
run reads depends on the softmax the model ends up with, the --init model's included. A resumed
run does not come here: it loads its checkpoint's model (checkpointing.py).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from elmo_pipeline.formats.files import model_shown
from elmo_pipeline.formats.shapes import shapes_only
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.config import NATIVE_FORMAT, NATIVE_FORMAT_VERSION, ElmoConfig, SoftmaxConfig
from elmo_pipeline.model.softmax import default_cutoffs
from elmo_pipeline.model.vocabulary import Vocabulary
from elmo_pipeline.strict import ConfigError
from elmo_pipeline.training import checkpointing as ckpt
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.shards import PreparedCorpus

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


def resolve_softmax(raw: dict[str, Any], vocab_size: int, kind: str | None = None, n_samples: int | None = None,
                    cutoffs: list[int] | None = None, where: str = "config.json") -> dict[str, Any]:
    """The softmax section for training: overrides applied, adaptive cutoffs made explicit
    (so that a growing vocabulary keeps its clusters). A model without a softmax (original
    weights) gets a full softmax for vocabularies up to 20,000 words, else an adaptive one.
    `where` is the file that errors name (the --model-config the section came from)."""
    out = dict(raw)
    out["kind"] = kind or out.get("kind", "none")
    if out["kind"] == "none":
        out["kind"] = "full" if vocab_size <= 20000 else "adaptive"
    _check_softmax_options(out["kind"], n_samples, cutoffs)
    if n_samples is not None:
        out["n_samples"] = n_samples
    if out["kind"] == "adaptive":
        past = [c for c in cutoffs or () if c >= vocab_size - 1]
        if past:  # given for this run: not dropped in silence as a preset's or an earlier model's are
            raise ValueError(f"--cutoffs {','.join(map(str, cutoffs))}: {past[0]} is past this run's vocabulary of "
                             f"{vocab_size} words (each cutoff must be below {vocab_size - 1})")
        chosen = list(cutoffs or out.get("cutoffs") or default_cutoffs(vocab_size))
        chosen = [c for c in chosen if c < vocab_size - 1]
        out["cutoffs"] = chosen or list(default_cutoffs(vocab_size))
    else:
        out["cutoffs"] = list(out.get("cutoffs") or [])
    SoftmaxConfig.from_dict(out, where)  # validate early, naming the file and the field
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
    if args.model_config and spec.get("char_dictionary") is not None:
        # a model's config.json (an imported ELMoForManyLangs one) copied as the shape: its dictionary
        # is that model's chars.json, which a new model does not have; BiLM's refusal named no file
        raise ConfigError(f"{args.model_config}: char_dictionary: a new model reads the UTF-8 bytes of its words; a "
                          "character dictionary belongs to the model whose chars.json it numbers: continue from "
                          "that model with --init, or leave the section out")
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


def tokens_outside(corpus: Vocabulary, vocab: Vocabulary, key: Callable[[list[str]], list[str]]) -> int | None:
    """How many of a prepared corpus's tokens `vocab` has no entry for (by the model's keys), each
    trained as its unknown word: with --no-grow-vocab, a corpus in another language is nearly all
    of them, and nothing said so. None when the corpus's vocabulary has no counts."""
    if corpus.counts is None:
        return None
    counts = dict(zip(corpus.tokens, corpus.counts))
    unknown = counts.pop(corpus.specials[2])  # the words prepare already counted as unknown
    for special in corpus.specials[:2]:
        counts.pop(special)
    return unknown + sum(c for k, c in zip(key(list(counts)), counts.values()) if k not in vocab.index)


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


def _start_new_words_as_unknown(model: BiLM, source: BiLM) -> None:
    """The word-embedding rows of the words the vocabulary gained start as the --init model's
    unknown word's row, the row that model read them by: left as initialised (N(0, 1)), they gave
    every sentence holding one other vectors before any step (the default model grown by 82 words
    of UD EWT: up to 6.8 apart at layer 0, 6.6 at layer 2), where the run should start from the
    model it was given. The softmax's new rows stay as initialised (no row gave those words)."""
    table, old = model.token_encoder.word_embedding, source.token_encoder.word_embedding
    if table is None or old is None or source.vocab is None:
        return
    with torch.no_grad():
        table.weight[len(source.vocab):] = old.weight[source.vocab.unk_id]


def build_model(args: TrainArgs, corpus: PreparedCorpus, log: Callable[[str], None],
                device: torch.device = torch.device("cpu")) -> BiLM:
    """The model a new run starts from; `device` is where it will train (its memory bounds a new shape)."""
    torch.manual_seed(args.seed)  # the same initial weights in every process
    if args.init:
        source = BiLM.load(args.init)
        if source.vocab is None and not args.grow_vocab:
            raise ValueError(f"--no-grow-vocab keeps the vocabulary of the --init model, and {args.init} has none "
                             "(its vocabulary is the corpus's): leave it out")
        vocab = corpus.vocab
        if source.vocab is not None and args.grow_vocab:
            vocab = grown_vocabulary(source.vocab, corpus.vocab, source.token_keys)
        elif source.vocab is not None:
            vocab = source.vocab
        config = _with_softmax(source.config, args, len(vocab))
        if config.softmax != source.config.softmax:  # a softmax kept as the model had it is not judged again
            _check_cluster_widths(config, args.cutoffs)
        if config.token_encoder != "char_cnn" and source.vocab is None:
            raise ValueError("a word-encoder model needs its vocabulary")
        model = BiLM(config, vocab, kernel=args.kernel, chars=source.chars)
        state = source.state_dict()
        if source.config.softmax.kind == "adaptive" and config.softmax.cutoffs != source.config.softmax.cutoffs:
            # --cutoffs asked for other clusters: their weights fit none of the new ones (they failed
            # to copy, naming a tensor), so the softmax is built new, as for another --softmax
            state = {name: value for name, value in state.items() if not name.startswith("softmax.")}
        skipped = _copy_prefix(model, state)
        _start_new_words_as_unknown(model, source)
        grew = len(vocab) - (len(source.vocab) if source.vocab is not None else 0)
        outside = tokens_outside(corpus.vocab, vocab, source.token_keys)
        log(f"init from {model_shown(args.init)}: vocabulary {len(vocab)} ({grew:+d}); new tensors: "
            f"{', '.join(skipped) if skipped else 'none'}"
            + (f"; {outside:,} of the corpus's {corpus.manifest.tokens:,} tokens are outside the vocabulary and "
               f"train as {vocab.specials[2]}" if outside is not None else ""))
        return model
    spec = _model_spec(args)
    raw = {"format": NATIVE_FORMAT, "format_version": NATIVE_FORMAT_VERSION, **spec, "vocab_size": len(corpus.vocab)}
    where = args.model_config or f"preset {args.preset!r}"
    raw["softmax"] = resolve_softmax(spec.get("softmax") or {"kind": "none"}, len(corpus.vocab), args.softmax,
                                     args.n_samples, args.cutoffs, where)
    config = ElmoConfig.from_dict(raw, where=where)
    _check_cluster_widths(config, args.cutoffs)
    _check_depth(config, where)
    _check_fits(config, corpus.vocab, args, device, where)
    return BiLM(config, corpus.vocab, kernel=args.kernel)


def _device_memory(device: torch.device) -> int | None:
    """Bytes of memory `device` has for this process, None where that cannot be told."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":  # torchrun's processes on this machine share its memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return None


# Layers a new model may stack (the original has 2 LSTM layers, 2 highway layers and 7 filter
# widths, a convolution each): each is a module built one by one, and a million of them took
# minutes before the first step (100,000 convolutions: more than 100 s), small or not.
MAX_NEW_LAYERS = 1000


def _check_depth(config: ElmoConfig, where: str) -> None:
    """Refuses a new model of more than MAX_NEW_LAYERS LSTM layers, highway layers or filter
    entries (convolutions), naming the field."""
    cnn = config.char_cnn
    counts = {"lstm.n_layers": config.lstm.n_layers, "char_cnn.n_highway": cnn.n_highway if cnn is not None else 0,
              "char_cnn.filters": len(cnn.filters) if cnn is not None else 0}
    deep = [f"{name} {count}" for name, count in counts.items() if count > MAX_NEW_LAYERS]
    if deep:
        raise ValueError(f"{where}: {', '.join(deep)}: a new model has at most {MAX_NEW_LAYERS} layers of each kind "
                         "(LSTM, highway, convolutions: the original has 2, 2 and 7); give fewer")


def _check_fits(config: ElmoConfig, vocab: Vocabulary, args: TrainArgs, device: torch.device, where: str) -> None:
    """Refuses a shape whose training state alone is larger than the device's memory: allocating
    it failed with the allocator's message naming no field (terabytes), or was killed by the
    kernel's out-of-memory killer minutes later without a word (tens of gigabytes)."""
    have = _device_memory(device)
    if have is None:
        return
    with shapes_only():  # nothing is allocated
        n = sum(p.numel() for p in BiLM(config, vocab, kernel=args.kernel).parameters())
    # float32 weights, their gradients and the optimizer's state (Adagrad one sum, Adam two moments)
    need = 4 * n * (4 if args.optimizer == "adam" else 3)
    if need > have:
        lstm, cnn = config.lstm, config.char_cnn
        shape = (f"lstm.dim {lstm.dim}, lstm.projection_dim {lstm.projection_dim}, lstm.n_layers {lstm.n_layers}"
                 + (f", char_cnn filters {cnn.n_filters}" if cnn is not None else "")
                 + (f", word_embedding_dim {config.word_embedding_dim}" if config.word_embedding_dim else ""))
        raise ValueError(f"{where}: {n:,} parameters ({shape}; vocabulary {len(vocab):,}) need {need / 2**30:,.1f} "
                         f"GiB to train (float32 weights, gradients and {args.optimizer} state), more than the "
                         f"{have / 2**30:,.1f} GiB this process has on its {device.type} device; give smaller sizes")


def _check_cluster_widths(config: ElmoConfig, given: list[int] | None) -> None:
    """Refuses an adaptive softmax whose tail cluster would be 0 wide: torch gives cluster k
    projection_dim // div_value**k dimensions, and at 0 every word of it is equally likely,
    silently (the 4th default cluster of a 128-wide model: words past rank 200,000)."""
    softmax = config.softmax
    if softmax.kind != "adaptive":
        return
    dim = config.lstm.projection_dim
    for k, start in enumerate(softmax.cutoffs, 1):
        if int(dim // softmax.div_value ** k) >= 1:
            continue
        fewer = (f"give --cutoffs with at most {k - 1} value{'s' if k > 2 else ''} (e.g. "
                 f"{','.join(map(str, softmax.cutoffs[: k - 1]))})" if k > 1 else "give --softmax full or sampled")
        origin = "--cutoffs " + ",".join(map(str, given)) if given else f"cutoffs {list(softmax.cutoffs)}"
        raise ValueError(f"{origin}: the adaptive softmax's cluster {k} (words from rank {start}) would have "
                         f"{dim} // {softmax.div_value:g}^{k} = 0 dimensions, every word in it equally likely; "
                         f"{fewer}")
