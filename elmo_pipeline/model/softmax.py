"""The biLM's output layer: one softmax shared by the forward and the backward LM.

Three kinds, chosen by `SoftmaxConfig.kind`:
- `full`: logits over the whole vocabulary; exact, affordable for small vocabularies.
- `sampled`: the same weights, but in training the normaliser is estimated from
  `n_samples` candidates drawn from a log-uniform (Zipfian) distribution over the ids, the
  original implementation's; the vocabulary must be in frequency order (ours is).
  Candidates are drawn with replacement (the original drew distinct ones, TensorFlow's
  sampler with unique=True), the log expected count is subtracted from every
  logit and candidates equal to a row's target are removed ("accidental hits").
  Evaluation always uses the full softmax.
- `adaptive`: the adaptive softmax (Grave et al. 2017): a head over the most frequent ids
  plus one entry per tail cluster, the tail clusters in smaller dimensions. It is an exact,
  normalised distribution, so training and evaluation compute the same quantity.

Every method takes hidden states (N, P) and targets (N,) and returns per-row negative log
likelihoods (N,), so callers choose how to reduce.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elmo_pipeline.model.batch_invariance import pad_rows, row_tiles
from elmo_pipeline.model.config import SoftmaxConfig
from elmo_pipeline.model.vocabulary import Vocabulary

# Rows of logits computed at once by the full softmax, so a huge vocabulary never needs an
# (N, V) matrix for a whole batch.
_MAX_LOGITS = 1 << 24


def default_cutoffs(vocab_size: int) -> tuple[int, ...]:
    """Adaptive-softmax cluster boundaries that depend only on the vocabulary size."""
    cutoffs = tuple(c for c in (2000, 10000, 50000, 200000) if c < vocab_size - 1)
    return cutoffs or (max(1, vocab_size // 2),)


class LmOutputLayer(nn.Module):
    def __init__(self, cfg: SoftmaxConfig, dim: int, vocab: Vocabulary | None) -> None:
        super().__init__()
        if cfg.kind == "none":
            raise ValueError("LmOutputLayer needs a softmax kind other than 'none'")
        if vocab is None:
            raise ValueError("a softmax needs the vocabulary")
        self.kind = cfg.kind
        self.dim = dim
        self.vocab_size = len(vocab)
        self.n_samples = cfg.n_samples
        if self.kind in ("full", "sampled"):
            self.weight = nn.Parameter(torch.empty(self.vocab_size, dim))
            self.bias = nn.Parameter(torch.zeros(self.vocab_size))
            nn.init.normal_(self.weight, std=dim ** -0.5)
            self.adaptive = None
        elif self.kind == "adaptive":
            cutoffs = list(cfg.cutoffs or default_cutoffs(self.vocab_size))
            if any(b <= a for a, b in zip(cutoffs, cutoffs[1:])) or cutoffs[0] < 1 or cutoffs[-1] >= self.vocab_size:
                raise ValueError(f"softmax.cutoffs {cutoffs} must increase strictly within 1..{self.vocab_size - 1}")
            self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(
                dim, self.vocab_size, cutoffs, div_value=cfg.div_value, head_bias=True)
        else:
            raise ValueError(f"unknown softmax kind {self.kind!r}")

    # -- exact ------------------------------------------------------------------------------
    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, V) log probabilities under the full, normalised distribution."""
        if self.adaptive is not None:
            return self.adaptive.log_prob(hidden)
        return F.log_softmax(F.linear(hidden, self.weight, self.bias), dim=-1)

    def nll(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(N,) exact negative log likelihood of `targets` with the full softmax."""
        if hidden.shape[0] == 0:
            return hidden.new_zeros(0)
        if self.adaptive is not None:
            return -self.adaptive(hidden, targets).output
        rows = max(1, _MAX_LOGITS // self.vocab_size)
        out = []
        for start in range(0, hidden.shape[0], rows):
            logits = F.linear(hidden[start : start + rows], self.weight, self.bias)
            out.append(F.cross_entropy(logits, targets[start : start + rows], reduction="none"))
        return torch.cat(out)

    def nll_in_row_tiles(self, hidden: torch.Tensor, targets: torch.Tensor, tile: int) -> torch.Tensor:
        """(N,) `nll` with every product over `tile` rows (fewer for a vocabulary too large for
        `tile` rows of logits), the last call padded: each row's value is then the same bits
        whatever other rows its batch holds, which an evaluation's sum needs to be."""
        if self.adaptive is None:
            tile = max(1, min(tile, _MAX_LOGITS // self.vocab_size))
            return _in_row_tiles(
                lambda h, t: F.cross_entropy(F.linear(h, self.weight, self.bias), t, reduction="none"),
                hidden, targets, tile)
        adaptive = self.adaptive
        bounds = [0, *adaptive.cutoffs]  # its cutoffs end with the vocabulary size
        head_targets, cluster_logprob = targets.clone(), hidden.new_zeros(targets.shape[0])
        for i in range(1, len(bounds) - 1):  # the tail clusters; the shortlist's words are in the head
            rows = ((targets >= bounds[i]) & (targets < bounds[i + 1])).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            head_targets[rows] = adaptive.shortlist_size + i - 1
            cluster_logprob[rows] = _in_row_tiles(_log_prob_of(adaptive.tail[i - 1]), hidden[rows],
                                                  targets[rows] - bounds[i], tile)
        return -(cluster_logprob + _in_row_tiles(_log_prob_of(adaptive.head), hidden, head_targets, tile))

    # -- training ---------------------------------------------------------------------------
    @property
    def samples(self) -> bool:
        """Whether training samples candidates: a sampled softmax with as many samples as words or
        more has nothing to leave out, and trains on the full softmax."""
        return self.kind == "sampled" and self.n_samples < self.vocab_size

    def training_nll(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(N,) the training objective per row: sampled in training mode for `sampled`, else exact."""
        if self.samples and self.training:
            return self.sampled_nll(hidden, targets)
        return self.nll(hidden, targets)

    def _log_expected_count(self, ids: torch.Tensor) -> torch.Tensor:
        # P(k) = log((k + 2) / (k + 1)) / log(V + 1); expected count over n_samples draws.
        k = ids.to(torch.float64)
        p = torch.log1p(1.0 / (k + 1.0)) / math.log(self.vocab_size + 1.0)
        return torch.log(p * self.n_samples).to(torch.float32)

    def sample_candidates(self, device: torch.device) -> torch.Tensor:
        """n_samples ids from the log-uniform distribution, drawn with the global torch RNG."""
        u = torch.rand(self.n_samples, dtype=torch.float64, device=device)
        ids = torch.floor(torch.exp(u * math.log(self.vocab_size + 1.0))).long() - 1
        return ids.clamp_(0, self.vocab_size - 1)

    def sampled_nll(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        samples = self.sample_candidates(hidden.device)
        true_w, true_b = self.weight[targets], self.bias[targets]
        true_logit = (hidden * true_w).sum(-1) + true_b - self._log_expected_count(targets).to(hidden.device)
        sample_logit = F.linear(hidden, self.weight[samples], self.bias[samples])
        sample_logit = sample_logit - self._log_expected_count(samples).to(hidden.device)
        hits = samples.unsqueeze(0) == targets.unsqueeze(1)
        sample_logit = sample_logit.masked_fill(hits, float("-inf"))
        logits = torch.cat([true_logit.unsqueeze(1), sample_logit], dim=1)
        return -F.log_softmax(logits, dim=1)[:, 0]


def _log_prob_of(layer: nn.Module):
    """(rows, targets) -> (rows,) the log probability `layer`'s logits give each row's target."""
    return lambda h, t: F.log_softmax(layer(h), dim=1).gather(1, t.unsqueeze(1)).squeeze(1)


def _in_row_tiles(fn, rows: torch.Tensor, targets: torch.Tensor, tile: int) -> torch.Tensor:
    """fn over `tile` rows at a time (the last call padded with zeros), cut back to the rows."""
    n = rows.shape[0]
    if n == 0:
        return rows.new_zeros(0)
    rows, targets = pad_rows(rows, 0, tile, tile), pad_rows(targets, 0, tile, tile)
    return torch.cat([fn(rows[s], targets[s]) for s in row_tiles(rows.shape[0], tile)])[:n]
