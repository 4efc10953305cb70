"""Per-token linear probes: one on each ELMo layer alone and one on a learned task mix.

The features come from Parquet files (`ParquetFeatureDataset`); the labels from the labelled token
file the sentences were read from, found again by `(doc_id, sentence_index, window_index)`.
All probes train together in one pass over the data per epoch (their parameters are disjoint, so
summing their losses trains each one as if alone); the mix probe is
`softmax(W ELMo_k + b)` with `ELMo_k = gamma * sum_j s_j h_{k,j}` and the L2 penalty on w.
Accuracy is measured on the dev set after the last epoch (no model selection on dev).
"""

from __future__ import annotations

import importlib.util
import io
import logging
import math
import textwrap
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from elmo_pipeline.model.scalar_mix import MixSpec
from elmo_pipeline.downstream.conll import LabelledSentence
from elmo_pipeline.downstream.dataset import FeatureBatch, ParquetFeatureDataset
from elmo_pipeline.embedding import too_long
from elmo_pipeline.downstream.mix import TrainableMix
from elmo_pipeline.progress import note_tokens, progress_bar
from elmo_pipeline.downstream.probe_config import ProbeConfig

IGNORE = -100  # padding, and tokens whose label the file leaves unspecified
UNSEEN = -1  # a dev label absent from training: never predicted, so counted as an error


def label_names(sentences: Sequence[LabelledSentence]) -> list[str]:
    """The distinct labels of `sentences`, sorted; an unspecified label (None) is none of them."""
    return sorted({label for s in sentences for label in s.labels if label is not None})


def check_labelled(sentences: Mapping[str, Sequence[LabelledSentence]], files: Mapping[str, str]) -> None:
    """Refuses a split without a single labelled token, which leaves nothing to train on or to score
    (the probe would otherwise fail deep inside training with an IndexError), and a train split of
    one label: every probe would learn to say it, and score 100% on a dev split of that label."""
    for split, found in sentences.items():
        if not any(label is not None for s in found for label in s.labels):
            raise ValueError(f"{split} file {files[split]} has no labelled tokens (no sentence was read from it, or "
                             "every label is '_', unspecified): nothing to probe; check --label")
    names = label_names(sentences.get("train", ()))
    if "train" in sentences and len(names) < 2:
        raise ValueError(f"train file {files['train']} has only the label {names[0]!r} (tokens labelled '_' left "
                         "out): a probe needs at least two labels to tell apart; check --label")


def check_lengths(sentences: Mapping[str, Sequence[LabelledSentence]], files: Mapping[str, str],
                  max_sentence_tokens: int) -> None:
    """Refuses a sentence longer than `max_sentence_tokens`, naming its file and place: the extraction
    embeds each whole, and one of 100,000 tokens needs some 6 GB with the default model."""
    for split, found in sentences.items():
        for number, sentence in enumerate(found, 1):
            why = too_long(len(sentence.tokens), max_sentence_tokens)
            if why is not None:
                named = f" (sent_id {sentence.sent_id})" if sentence.sent_id is not None else ""
                raise ValueError(f"{split} file {files[split]}, sentence {number}{named}: {why}")


class LabelTable:
    """Label ids per sentence, looked up for the sentences of a FeatureBatch."""

    def __init__(self, doc_id: str, sentences: Sequence[LabelledSentence], label_names: Sequence[str],
                 window: int | None = None) -> None:
        self.doc_id = doc_id
        self.index = {name: i for i, name in enumerate(label_names)}
        self.window = window
        self.labels = [np.array([self._id(label) for label in s.labels], np.int64) for s in sentences]

    def _id(self, label: str | None) -> int:
        return IGNORE if label is None else self.index.get(label, UNSEEN)

    def for_batch(self, batch: FeatureBatch) -> torch.Tensor:
        """(B, T) label ids, IGNORE at padding and for unspecified labels, UNSEEN for labels that
        training did not have."""
        out = np.full(tuple(batch.mask.shape), IGNORE, np.int64)
        for row, (doc_id, s, w, n) in enumerate(zip(batch.doc_ids, batch.sentence_index.tolist(),
                                                     batch.window_index.tolist(), batch.lengths.tolist())):
            if doc_id != self.doc_id:
                raise ValueError(f"features of {doc_id!r} given with the labels of {self.doc_id!r}")
            if s >= len(self.labels):
                raise ValueError(f"features of sentence {s} of {doc_id!r}, whose labels have {len(self.labels)} "
                                 "sentences: the features are of another file")
            lo = w * self.window if w else 0
            labels = self.labels[s][lo:lo + n]
            if len(labels) != n:
                raise ValueError(f"sentence {doc_id}:{s}:{w} has {n} feature rows and {len(labels)} labels")
            out[row, :n] = labels
        return torch.from_numpy(out)

    def tally(self, batch: FeatureBatch, covered: np.ndarray) -> None:
        """Adds the batch's feature rows to `covered` (rows per sentence; zeros to start a pass)."""
        np.add.at(covered, batch.sentence_index.numpy(), batch.lengths.numpy())

    def check_covered(self, covered: np.ndarray, split: str) -> None:
        """Every token of every sentence read once in a pass: a shard lost or copied (features
        reused from an earlier run) would otherwise change what is trained on and scored."""
        lengths = np.array([len(labels) for labels in self.labels], np.int64)
        if not np.array_equal(covered, lengths):
            short, over = int((covered < lengths).sum()), int((covered > lengths).sum())
            raise ValueError(f"the {split} features hold {int(covered.sum())} token rows for the {int(lengths.sum())} "
                             f"tokens of {self.doc_id}'s labelled file ({short} sentences short, {over} read more "
                             "than once): shards of the features are missing or repeated; run probe without "
                             "--reuse-features to extract them again")


class LayerProbes(nn.Module):
    """A linear classifier per layer and one on a TrainableMix of all layers."""

    def __init__(self, n_layers: int, dim: int, n_labels: int, mix: TrainableMix) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(dim, n_labels) for _ in range(n_layers))
        self.mix = mix
        self.mix_head = nn.Linear(dim, n_labels)

    @property
    def names(self) -> list[str]:
        return [f"layer_{j}" for j in range(len(self.heads))] + ["mix"]

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """features (K, B, T, D) -> logits (B, T, C) per probe, in the order of `names`."""
        logits = [head(features[j]) for j, head in enumerate(self.heads)]
        logits.append(self.mix_head(self.mix(features, mask)))
        return logits


@dataclass
class ProbeResult:
    accuracy: dict[str, float]  # dev accuracy per probe: layer_0..layer_L, mix
    train_accuracy: dict[str, float]  # on the last epoch's batches, in training mode
    loss_per_epoch: list[float]
    mix_weights: list[float]  # after the softmax
    mix_raw_weights: list[float]
    gamma: float
    layer_norm: bool
    train_tokens: int
    dev_tokens: int
    seconds: float
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def best_layer(self) -> str:
        layers = {k: v for k, v in self.accuracy.items() if k.startswith("layer_")}
        return max(layers, key=layers.get)

    def mix_spec(self, layers_sha256: str | None = None) -> MixSpec:
        """The learned mix; `layers_sha256`, the digest of the layers it mixes (`layers_digest`),
        goes into the spec so that `extract` applies it to those layers only."""
        return MixSpec(tuple(self.mix_raw_weights), self.gamma, self.layer_norm, layers_sha256)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["best_layer"] = self.best_layer
        return out


def _correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    keep = labels != IGNORE
    return int((logits.argmax(-1)[keep] == labels[keep]).sum()), int(keep.sum())


def train_probes(
    train: ParquetFeatureDataset, dev: ParquetFeatureDataset, train_labels: LabelTable, dev_labels: LabelTable,
    n_labels: int, config: ProbeConfig | None = None, log: Callable[[str], None] | None = None,
    show_progress: bool = True,
) -> ProbeResult:
    config = config or ProbeConfig()
    start = time.monotonic()
    if train.columns != dev.columns or train.width != dev.width:
        raise ValueError(f"train has {train.columns} (width {train.width}), dev {dev.columns} (width {dev.width})")
    torch.manual_seed(config.seed)
    mix = TrainableMix(len(train.columns), config.l2_lambda, config.dropout, config.layer_norm)
    model = LayerProbes(len(train.columns), train.width, n_labels, mix)
    optimizer = torch.optim.Adam([
        {"params": [p for n, p in model.named_parameters() if not n.startswith("mix.")], "lr": config.lr},
        {"params": list(mix.parameters()), "lr": config.mix_lr},
    ])
    # cosine decay per epoch, to a small fraction of the learning rate in the last epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: 0.5 * (1 + math.cos(math.pi * epoch / config.epochs)))
    losses: list[float] = []
    correct: Counter = Counter()
    seen = 0
    progress = progress_bar("probe", enabled=show_progress)
    for epoch in range(config.epochs):
        progress.set_description(f"probe epoch {epoch + 1}/{config.epochs}", refresh=False)
        train.set_epoch(epoch)
        loss, correct, seen = _train_epoch(model, train, train_labels, optimizer, n_labels, progress)
        losses.append(loss)
        schedule.step()
        if log:
            log(f"epoch {epoch + 1}/{config.epochs}: loss {losses[-1]:.4f} (summed over {len(model.names)} probes), "
                f"mix weights {[round(w, 3) for w in mix.weights()]}, gamma {mix.gamma():.3f}")
    progress.close()
    accuracy, dev_tokens = evaluate(model, dev, dev_labels)
    return ProbeResult(
        accuracy=accuracy,
        train_accuracy={name: correct[name] / max(seen, 1) for name in model.names},
        loss_per_epoch=losses,
        mix_weights=mix.weights(),
        mix_raw_weights=[float(w) for w in mix.mix.weights.detach()],
        gamma=mix.gamma(),
        layer_norm=config.layer_norm,
        train_tokens=seen,
        dev_tokens=dev_tokens,
        seconds=round(time.monotonic() - start, 2),
        config=asdict(config),
    )


def _train_epoch(model: LayerProbes, train: ParquetFeatureDataset, train_labels: LabelTable,
                 optimizer: torch.optim.Optimizer, n_labels: int, progress: tqdm) -> tuple[float, Counter, int]:
    """One pass over `train`: (mean summed loss per batch, correct predictions per probe, labelled tokens)."""
    model.train()
    loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE)
    total, batches, seen = 0.0, 0, 0
    correct: Counter = Counter()
    covered = np.zeros(len(train_labels.labels), np.int64)
    for batch in train:
        labels = train_labels.for_batch(batch)
        train_labels.tally(batch, covered)
        if not bool((labels != IGNORE).any()):
            continue  # only unspecified labels: the mean loss over no token is NaN
        logits = model(batch.features, batch.mask)
        loss = sum(loss_fn(out.reshape(-1, n_labels), labels.reshape(-1)) for out in logits) + model.mix.penalty()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += float(loss.detach())
        if not math.isfinite(total):
            raise ValueError(f"the probe's loss is {total} after {batches + 1} batch(es): the features hold NaN or "
                             "infinite values, or --lr / --mix-lr is too large")
        batches += 1
        for name, out in zip(model.names, logits):
            correct[name] += _correct(out.detach(), labels)[0]
        tokens = int((labels != IGNORE).sum())
        seen += tokens
        note_tokens(progress, len(batch.doc_ids), tokens)
    train_labels.check_covered(covered, "train")
    return total / max(batches, 1), correct, seen


@torch.no_grad()
def evaluate(model: LayerProbes, data: ParquetFeatureDataset, labels: LabelTable) -> tuple[dict[str, float], int]:
    model.eval()
    correct: Counter = Counter()
    total = 0
    covered = np.zeros(len(labels.labels), np.int64)
    for batch in data:
        gold = labels.for_batch(batch)
        labels.tally(batch, covered)
        for name, out in zip(model.names, model(batch.features, batch.mask)):
            correct[name] += _correct(out, gold)[0]
        total += int((gold != IGNORE).sum())
    labels.check_covered(covered, labels.doc_id)
    return {name: correct[name] / max(total, 1) for name in model.names}, total


# -- reference points computed from the labelled files alone ---------------------------------------
def baselines(train: Sequence[LabelledSentence], dev: Sequence[LabelledSentence]) -> dict[str, float]:
    """Dev accuracy of the most frequent label, and of each word's most frequent training label
    (the most frequent label for words unseen in training). Tokens whose label is unspecified
    (None) count nowhere, as in the probes."""
    overall: Counter = Counter(label for s in train for label in s.labels if label is not None)
    majority = overall.most_common(1)[0][0]
    per_word: dict[str, Counter] = defaultdict(Counter)
    for s in train:
        for token, label in zip(s.tokens, s.labels):
            if label is not None:
                per_word[token][label] += 1
    best = {token: counts.most_common(1)[0][0] for token, counts in per_word.items()}
    gold = [(t, label) for s in dev for t, label in zip(s.tokens, s.labels) if label is not None]
    n = max(len(gold), 1)
    return {
        "majority_label": sum(label == majority for _, label in gold) / n,
        "word_majority_label": sum(best.get(t, majority) == label for t, label in gold) / n,
    }


# -- chart -------------------------------------------------------------------------------------------
def check_plotting() -> None:
    """Raises ImportError, with the line that installs it, when matplotlib (an extra) is missing:
    checked before the extraction and the training, not after them."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("probe draws probe.png with matplotlib, which is not installed: "
                          "pip install 'elmo-pipeline[downstream]' (or matplotlib)")


def chart_fonts(texts: Sequence[str]) -> tuple[list[str], str]:
    """The font families to draw `texts` with, and the characters no installed font has. matplotlib
    looks for a glyph only in the families it is given (DejaVu Sans has no Chinese): a task or model
    name in another script came out as boxes beside a warning per glyph. Installed fonts that have
    what the default lacks follow it in the list, which matplotlib falls back along glyph by glyph.
    They are taken by name, each for the face matplotlib draws it with: the font cache lists faces in
    an order set where it was built (two machines drew one report with two fonts), and a family's
    bold face, or a second copy of it, may hold a glyph the face drawn lacks."""
    from matplotlib import font_manager, rcParams

    families = list(rcParams["font.family"])
    default = font_manager.findfont(font_manager.FontProperties(family=families))
    missing = {ord(c) for text in texts for c in text if not c.isspace()} - _glyphs(default)
    faces = font_manager.fontManager.ttflist if missing else []
    holding = {entry.name for entry in faces if not entry.name.startswith("Last Resort")  # its boxes are no glyphs
               and missing & _glyphs(entry.fname)}
    # a family without a face of weight 400 (a CJK font may have a medium one alone) last: matplotlib
    # logs a line each time it draws with one
    regular = {entry.name for entry in faces if font_manager.weight_dict.get(entry.weight, entry.weight) == 400}
    for name in sorted(holding, key=lambda family: (family not in regular, family)):
        drawn_with = font_manager.findfont(font_manager.FontProperties(family=[name]), fallback_to_default=False)
        has = missing & _glyphs(drawn_with)
        if has:
            families.append(name)
            missing -= has
        if not missing:
            break
    return families, "".join(sorted(map(chr, missing)))


def _glyphs(font_file: str) -> set[int]:
    """The code points `font_file` has a glyph for; none for a file FreeType cannot read (it draws none)."""
    from matplotlib import font_manager

    try:
        return set(font_manager.get_font(font_file).get_charmap())
    except (OSError, RuntimeError):
        return set()


def plot_report(report: Mapping[str, Any]) -> bytes:
    """The chart as PNG bytes: dev accuracy per probe (layers and mix, baselines as lines) and the mix weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task, model = report.get("task", {}), report.get("model", {})
    families, missing = chart_fonts([task.get("name", ""), task.get("label", ""), model.get("name") or ""])
    if missing:
        logging.getLogger(__name__).warning(
            "probe.png: no font installed here has %s (of the task or model name), drawn as boxes; report.json "
            "holds the name (a font with them, such as Noto Sans CJK for Chinese, draws them)", " ".join(missing))
    with plt.rc_context({"font.family": families}), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")  # named above, once
        return _draw_report(report)


def _draw_report(report: Mapping[str, Any]) -> bytes:
    import matplotlib.pyplot as plt

    accuracy = report["accuracy"]
    names = list(accuracy)
    values = [100 * accuracy[n] for n in names]
    weights = report["mix"]["weights"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    colors = ["#4C72B0"] * (len(names) - 1) + ["#DD8452"]
    bars = left.bar(names, values, color=colors)
    for bar, value in zip(bars, values):
        left.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                      fontsize=9, xytext=(0, 2), textcoords="offset points")
    # zoomed on the probes; a baseline below the axis stays in the legend with its value
    left.set_ylim(max(0.0, math.floor(min(values) / 5) * 5 - 5), 100)
    for (name, value), style in zip(report.get("baselines", {}).items(), (":", "--")):
        left.axhline(100 * value, color="gray", linestyle=style, linewidth=1, label=f"{name} {100 * value:.1f}")
    if report.get("baselines"):
        left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8, frameon=False)
    left.set_ylabel("dev accuracy (%)")
    task = report.get("task", {})
    # the task name, file names and model name are the user's text, not TeX: between two `$` an
    # unknown command failed the run after its training, and "$5 and $6" lost its dollars
    left.set_title("\n".join(textwrap.wrap(task.get("name", ""), 70)), fontsize=9, parse_math=False)
    right.bar([f"s_{j}" for j in range(len(weights))], weights, color="#55A868")
    for j, w in enumerate(weights):
        right.annotate(f"{w:.2f}", (j, w), ha="center", va="bottom", fontsize=9, xytext=(0, 2),
                       textcoords="offset points")
    right.set_ylim(0, 1)
    right.set_title(f"learned mix weights (softmax), gamma = {report['mix']['gamma']:.2f}", fontsize=10)
    model = report.get("model", {})
    fig.suptitle(f"per-token linear probes ({task.get('label', 'label')}), model {model.get('name') or ''} "
                 f"({str(model.get('sha256') or '')[:12]})", fontsize=10, parse_math=False)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()
