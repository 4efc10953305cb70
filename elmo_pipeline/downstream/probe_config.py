"""What trains a probe (epochs, rates, batches, the mix's penalty), kept free of torch so that
`probe --help` is built without it."""

from __future__ import annotations

from dataclasses import dataclass

from elmo_pipeline.runtime_choices import FLOAT32_MAX, MAX_SEED


@dataclass
class ProbeConfig:
    epochs: int = 10
    lr: float = 0.02  # Adam, every probe; cosine decay over the epochs
    mix_lr: float = 0.05  # Adam, the mix weights and gamma
    batch_sentences: int = 32
    # padded tokens (B * T) per batch at most, a batch of long sentences holding fewer: bounded by
    # sentences alone, 32 sentences of 3,000 tokens made a batch of 96,000 token vectors per layer
    batch_tokens: int = 32_768
    shuffle_buffer: int = 2048  # sentences
    # tokens in the shuffle buffer at most (or one sentence): by sentences alone, 2,048 sentences of
    # 3,000 tokens held 6.1M token vectors per layer (8.8 GiB at the default model's width in float16).
    # 64 tokens a sentence on average: UD EWT's 2,048 hold 33,400 on average (the same shuffle)
    shuffle_tokens: int = 131_072
    l2_lambda: float = 0.001  # the paper's lambda on the mix weights
    dropout: float = 0.0  # on the mixed vector, in training
    layer_norm: bool = False  # per-token layer norm before mixing (kept in the mix spec)
    seed: int = 0

    def __post_init__(self) -> None:
        """Each value in its range, as a message naming the option: checked before any extraction."""
        checks = [("--epochs", self.epochs, self.epochs >= 1, ">= 1"),
                  ("--batch-sentences", self.batch_sentences, self.batch_sentences >= 1, ">= 1"),
                  ("batch_tokens", self.batch_tokens, self.batch_tokens >= 1, ">= 1"),
                  ("--shuffle-buffer", self.shuffle_buffer, self.shuffle_buffer >= 0, ">= 0"),
                  ("shuffle_tokens", self.shuffle_tokens, self.shuffle_tokens >= 1, ">= 1"),
                  ("--lr", self.lr, 0 < self.lr <= FLOAT32_MAX, f"> 0 and at most {FLOAT32_MAX:.4g}"),
                  ("--mix-lr", self.mix_lr, 0 < self.mix_lr <= FLOAT32_MAX, f"> 0 and at most {FLOAT32_MAX:.4g}"),
                  ("--l2", self.l2_lambda, 0 <= self.l2_lambda <= FLOAT32_MAX, f">= 0 and at most {FLOAT32_MAX:.4g}"),
                  ("--dropout", self.dropout, 0 <= self.dropout < 1, "in [0, 1)"),
                  ("--seed", self.seed, isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED,
                   f"an integer from 0 to {MAX_SEED}")]
        for option, value, ok, bound in checks:
            if not ok:
                raise ValueError(f"{option} must be {bound}, got {value}")
