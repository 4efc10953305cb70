"""The language-model objective shared by training and evaluation.

A batch is turned into tensors once (distinct words -> char ids / word ids, an index that
places their representations, the target ids), so the char CNN runs once per distinct word
of the batch. Every sentence starts from a zero LSTM state, as in extraction: the model is
trained exactly the way it is later used, and its features never depend on the batch.

Sequences are `<S> w_1 .. w_n </S>`. The forward LM predicts position t+1 from its output at
t (so it predicts w_1 .. w_n and `</S>`); the backward LM predicts t-1 from t (w_n .. w_1 and
`<S>`). Both read the same token representations and share one softmax; the loss is
0.5 * (mean forward NLL + mean backward NLL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from elmo_pipeline.model.batch_invariance import PREDICTION_TILE
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.lstm import FUSED


@dataclass
class LmBatch:
    char_ids: torch.Tensor | None  # (U, C) distinct words incl. boundaries
    word_ids: torch.Tensor | None  # (U,)
    index: torch.Tensor  # (B, T+2) positions into the U representations; U = padding (zero row)
    lengths: torch.Tensor  # (B,) with boundaries, on the CPU
    targets: torch.Tensor  # (B, T+2) vocabulary ids; padding 0
    n_words: int  # corpus tokens (boundaries excluded)
    n_unknown: int  # of those, the words outside the vocabulary: their target is the unknown word's

    @property
    def n_predictions(self) -> int:
        """Predictions per direction: n + 1 per sentence."""
        return self.n_words + int(self.lengths.numel())

    def to(self, device: torch.device) -> "LmBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return LmBatch(move(self.char_ids), move(self.word_ids), move(self.index), self.lengths,
                       move(self.targets), self.n_words, self.n_unknown)


def make_batch(model: BiLM, sentences: Sequence[Sequence[str]], ids: Sequence[np.ndarray] | None = None) -> LmBatch:
    """Tensors for a batch of sentences (lists of words, no boundaries).

    `ids` are the words' vocabulary ids when they are already known (from the shards) and
    belong to `model.vocab`; otherwise they are looked up (unknown words -> `<UNK>`) by the
    model's own keys (`BiLM.token_keys`), as are the characters.
    """
    if not sentences:
        raise ValueError("a batch needs at least one sentence")
    vocab = model.vocab
    if vocab is None:
        raise ValueError("the language-model objective needs a model with a vocabulary")
    start, end = model.boundary_tokens
    slot: dict[str, int] = {start: 0, end: 1}
    width = max(len(s) for s in sentences) + 2
    b = len(sentences)
    index = np.empty((b, width), dtype=np.int64)
    targets = np.zeros((b, width), dtype=np.int64)
    n_words = n_unknown = 0
    for row, words in enumerate(sentences):
        words = model.token_keys(words)
        n = len(words)
        n_words += n
        positions = [slot.setdefault(w, len(slot)) for w in words]
        index[row, 0] = 0
        index[row, 1 : n + 1] = positions
        index[row, n + 1] = 1
        targets[row, 0] = vocab.start_id
        targets[row, 1 : n + 1] = ids[row] if ids is not None else vocab.ids(words)
        n_unknown += int(np.count_nonzero(targets[row, 1 : n + 1] == vocab.unk_id))
        targets[row, n + 1] = vocab.end_id
        index[row, n + 2 :] = -1
    distinct = list(slot)
    index[index < 0] = len(distinct)
    enc = model.token_encoder
    char_ids = word_ids = None
    if enc.uses_chars:
        char_ids = torch.from_numpy(model.char_ids(distinct))
    if enc.uses_words:
        word_ids = torch.from_numpy(vocab.ids(distinct))
    lengths = torch.tensor([len(s) + 2 for s in sentences], dtype=torch.int64)
    return LmBatch(char_ids, word_ids, torch.from_numpy(index), lengths, torch.from_numpy(targets), n_words,
                   n_unknown)


class LmObjective(nn.Module):
    """Wraps a BiLM so that one call (and so one DistributedDataParallel forward) computes
    the summed forward and backward NLL of a batch; with `per_prediction`, the NLL of each
    prediction instead (forward ones, then backward ones), for sums that do not depend on how they
    are grouped (`evaluate.ExactSum`)."""

    def __init__(self, model: BiLM, per_prediction: bool = False) -> None:
        super().__init__()
        if model.softmax is None:
            raise ValueError("this model has no softmax (config softmax.kind is 'none'); "
                             "give it an output layer before training or evaluating")
        self.model = model
        self.per_prediction = per_prediction

    def forward(self, char_ids: torch.Tensor | None, word_ids: torch.Tensor | None, index: torch.Tensor,
                lengths: torch.Tensor, targets: torch.Tensor, dropout: float = 0.0,
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        model = self.model
        reps = model.token_encoder(char_ids, word_ids)  # (U, P)
        reps = torch.cat([reps, reps.new_zeros(1, reps.shape[1])])
        tokens = reps[index]  # (B, T+2, P)
        if torch.is_grad_enabled() and model.kernel != FUSED:
            # training: the reference recurrence, whose backward costs O(T)
            layers, _ = model.lstm.reference_forward(tokens, lengths, dropout=dropout)
        else:  # evaluation, and training asked for the fused kernel (cuDNN's own backward on a GPU)
            layers, _ = model(tokens, lengths, dropout=dropout)
        top = layers[-1]  # (2, B, T+2, P)
        if dropout and self.training:
            top = F.dropout(top, dropout, True)
        width = index.shape[1]
        valid = (torch.arange(width, device=index.device).unsqueeze(0) < lengths.to(index.device).unsqueeze(1))
        valid = valid[:, 1:]  # (B, T+1): predictions exist where the later position exists
        fwd_h, fwd_t = top[0][:, :-1][valid], targets[:, 1:][valid]
        bwd_h, bwd_t = top[1][:, 1:][valid], targets[:, :-1][valid]
        hidden = torch.cat([fwd_h, bwd_h]).float()
        target = torch.cat([fwd_t, bwd_t])
        assert model.softmax is not None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            if self.per_prediction:  # evaluation: each prediction's NLL the same bits in any batch
                nll = model.softmax.nll_in_row_tiles(hidden, target, PREDICTION_TILE)
            else:
                nll = model.softmax.training_nll(hidden, target)
        n = fwd_t.shape[0]
        if self.per_prediction:
            return nll[:n], nll[n:], n  # (n,) each
        return nll[:n].sum(), nll[n:].sum(), n


def run_objective(objective: nn.Module, batch: LmBatch, dropout: float = 0.0,
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    return objective(batch.char_ids, batch.word_ids, batch.index, batch.lengths, batch.targets, dropout)
