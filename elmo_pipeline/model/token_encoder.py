"""Context-free token representations: char CNN, word embedding, or both fused.

Every encoder maps a flat batch of N tokens to (N, P) where P is the LSTM projection size, so
the biLM and the word cache do not care which one is in use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elmo_pipeline.model.batch_invariance import pad_rows, word_tiles
from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig
from elmo_pipeline.runtime import product_dtype


class Highway(nn.Module):
    """y = g * relu(x W_t + b_t) + (1 - g) * x with g = sigmoid(x W_c + b_c), as in the original file."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.transform = nn.Linear(dim, dim)
        self.carry = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, F) -> (N, F)
        gate = torch.sigmoid(self.carry(x))
        return gate * F.relu(self.transform(x)) + (1.0 - gate) * x


def _in_16_bits(x: torch.Tensor) -> bool:
    """Whether products on `x` run in bf16/fp16 (its dtype, or autocast's on its device)."""
    return product_dtype(x, x.dtype) in (torch.bfloat16, torch.float16)


def _conv_max_channels_last(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """(N, C, d) -> (N, filters): `conv` then the max over positions, with the channels innermost.

    In 16 bits the max over the ~50 positions of an (N, filters, positions) output is the slowest
    part of the char CNN on CPU (a reduction over a short contiguous axis); the embedding's own
    layout is already channels-last for a 2-d convolution over (1, C), whose output then keeps
    the filters innermost and the max runs across them. float32 keeps the other path: there the
    width-1 convolution would sum in another order and change the last bit."""
    y = F.conv2d(x.unsqueeze(1).permute(0, 3, 1, 2), conv.weight.unsqueeze(2), conv.bias)  # (N, F, 1, L)
    return y.amax(dim=(2, 3))


class CharCNN(nn.Module):
    """Char embeddings -> convolutions of several widths -> max over positions -> highways.

    Returns the (N, F) highway output; the projection to P belongs to the encoder because the
    fused encoder projects the char features together with the word embedding.
    """

    def __init__(self, cfg: CharCnnConfig, dictionary_size: int | None = None) -> None:
        super().__init__()
        if dictionary_size is None:  # UTF-8 bytes: 262 rows, row 0 is the padding token and stays zero
            self.char_embedding = nn.Embedding(262, cfg.embedding_dim, padding_idx=0)
        else:  # a character dictionary's ids, its own `<pad>` row included
            self.char_embedding = nn.Embedding(dictionary_size, cfg.embedding_dim)
        self.convs = nn.ModuleList(nn.Conv1d(cfg.embedding_dim, n, width) for width, n in cfg.filters)
        self.activation = torch.relu if cfg.activation == "relu" else torch.tanh
        self.highways = nn.ModuleList(Highway(cfg.n_filters) for _ in range(cfg.n_highway))

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:  # (N, C) -> (N, F)
        x = self.char_embedding(char_ids)  # (N, C, d)
        # max over positions, then the activation (monotonic, so the order is the original's)
        if _in_16_bits(x):
            pooled = [self.activation(_conv_max_channels_last(conv, x)) for conv in self.convs]
        else:
            x = x.transpose(1, 2)  # (N, d, C)
            pooled = [self.activation(conv(x).amax(dim=-1)) for conv in self.convs]
        h = torch.cat(pooled, dim=-1)
        for highway in self.highways:
            h = highway(h)
        return h


class TokenEncoder(nn.Module):
    """Chooses char CNN, word embedding, or both (concatenated, then projected) by config."""

    def __init__(self, cfg: ElmoConfig) -> None:
        super().__init__()
        self.kind = cfg.token_encoder
        p = cfg.lstm.projection_dim
        in_dim = 0
        self.char_cnn = None
        self.word_embedding = None
        if self.kind in ("char_cnn", "char_cnn+word"):
            assert cfg.char_cnn is not None
            self.char_cnn = CharCNN(cfg.char_cnn, cfg.char_dictionary.size if cfg.char_dictionary else None)
            in_dim += cfg.char_cnn.n_filters
        if self.kind in ("word", "char_cnn+word"):
            assert cfg.vocab_size and cfg.word_embedding_dim
            self.word_embedding = nn.Embedding(cfg.vocab_size, cfg.word_embedding_dim)
            in_dim += cfg.word_embedding_dim
        self.projection = nn.Linear(in_dim, p)

    @property
    def uses_chars(self) -> bool:
        return self.char_cnn is not None

    @property
    def uses_words(self) -> bool:
        return self.word_embedding is not None

    def forward(self, char_ids: torch.Tensor | None, word_ids: torch.Tensor | None) -> torch.Tensor:
        # char_ids (N, C), word_ids (N,) -> (N, P). The rows are padded and, on CPU, encoded
        # WORD_TILE at a time (see batch_invariance), so that no word depends on N or its neighbours.
        if self.char_cnn is not None:
            assert char_ids is not None, "this model's token encoder needs character ids"
        if self.word_embedding is not None:
            assert word_ids is not None, "this model's token encoder needs word ids"
        ids = char_ids if char_ids is not None else word_ids
        assert ids is not None
        n = ids.shape[0]
        rows, tiles = word_tiles(n, ids.device)
        chars, words = (None if v is None else pad_rows(v, minimum=rows) for v in (char_ids, word_ids))
        encoded = [self._encode(None if chars is None else chars[tile], None if words is None else words[tile])
                   for tile in tiles]
        return (encoded[0] if len(encoded) == 1 else torch.cat(encoded))[:n]

    def _encode(self, char_ids: torch.Tensor | None, word_ids: torch.Tensor | None) -> torch.Tensor:
        parts = []
        if self.char_cnn is not None:
            parts.append(self.char_cnn(char_ids))
        if self.word_embedding is not None:
            parts.append(self.word_embedding(word_ids))
        h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return self.projection(h)
