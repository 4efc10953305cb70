"""Streaming a prepared corpus into batches, reproducibly, from any saved position.

Per epoch the shard order is a permutation drawn from (seed, epoch); inside a shard the
sentences are sorted by length with random ties drawn from (seed, epoch, shard), cut into
batches of at most `batch_tokens` padded tokens, and the batches are shuffled. With several
processes, process r takes batches r, r + W, r + 2W, ... of each shard, the last round filled
with the shard's first batches again (as torch's DistributedSampler pads), so that every
process runs the same number of steps and no batch is left out. Only one shard is in memory
at a time. A position is (epoch, shard_pos, batch_pos): the next batch to read is batch
`batch_pos` of this process in shard `order[shard_pos]` of `epoch`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

import numpy as np

from elmo_pipeline.training.shards import PreparedCorpus


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    shard_pos: int = 0
    batch_pos: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "Position":
        return cls(int(raw["epoch"]), int(raw["shard_pos"]), int(raw["batch_pos"]))


def length_batches(lengths: Sequence[int], batch_tokens: int, max_sentences: int,
                   rng: np.random.Generator | None) -> list[np.ndarray]:
    """Row indices of batches of similar lengths; padded size (longest + 2) * rows <= batch_tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return []
    ties = rng.random(len(lengths)) if rng is not None else np.arange(len(lengths))
    order = np.lexsort((ties, lengths))
    batches: list[np.ndarray] = []
    start = 0
    longest = 0
    for i, row in enumerate(order):
        size = int(lengths[row]) + 2
        rows = i - start
        if rows and (max(longest, size) * (rows + 1) > batch_tokens or rows >= max_sentences):
            batches.append(order[start:i])
            start, longest = i, 0
        longest = max(longest, size)
    batches.append(order[start:])
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


class BatchStream:
    def __init__(self, corpus: PreparedCorpus, *, seed: int, batch_tokens: int, max_sentences: int = 512,
                 rank: int = 0, world_size: int = 1) -> None:
        self.corpus = corpus
        self.seed, self.batch_tokens, self.max_sentences = seed, batch_tokens, max_sentences
        self.rank, self.world_size = rank, world_size

    def shard_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(self.corpus.n_shards)

    def my_batches(self, epoch: int, shard: int, lengths: Sequence[int]) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch, shard])
        batches = length_batches(lengths, self.batch_tokens, self.max_sentences, rng)
        # no remainder dropped: it left up to W - 1 batches of every shard untrained, and all of a
        # shard with fewer batches than processes (a small corpus: the run "finished" at step 0)
        rounds = math.ceil(len(batches) / self.world_size)
        return [batches[i % len(batches)] for i in range(self.rank, rounds * self.world_size, self.world_size)]

    def iterate(self, start: Position, epochs: int | None = None,
                ) -> Iterator[tuple[list[list[str]], list[np.ndarray], Position]]:
        """Yield (sentences, ids, position after this batch) from `start` to the end of `epochs`."""
        epoch = start.epoch
        first = True
        while epochs is None or epoch < epochs:
            order = self.shard_order(epoch)
            shard_from = start.shard_pos if first else 0
            for shard_pos in range(shard_from, len(order)):
                batch_from = start.batch_pos if (first and shard_pos == start.shard_pos) else 0
                shard = int(order[shard_pos])
                tokens, ids = self.corpus.read_shard(shard)
                batches = self.my_batches(epoch, shard, [len(t) for t in tokens])
                for batch_pos in range(batch_from, len(batches)):
                    rows = batches[batch_pos]
                    yield ([tokens[i] for i in rows], [ids[i] for i in rows],
                           Position(epoch, shard_pos, batch_pos + 1))
                del tokens, ids
            first = False
            epoch += 1

    def batching(self) -> dict[str, int]:
        """What cuts the data into the batches a Position counts: the seed orders the shards and
        their batches, the others cut them."""
        return {"seed": self.seed, "batch_tokens": self.batch_tokens, "max_batch_sentences": self.max_sentences,
                "processes": self.world_size}

    def resumed_position(self, position: Position, then: dict[str, int]) -> Position:
        """`position`, counted in the batches of `then` (an earlier `batching`), in this stream's.
        Another cut is taken where the position is at a shard's start or end, and another seed at
        an epoch's; elsewhere ValueError: the rest of the shard (or epoch) would skip some
        sentences and train others twice."""
        changed = [name for name, value in self.batching().items() if then.get(name) != value]
        if not changed:
            return position
        earlier = BatchStream(self.corpus, seed=then["seed"], batch_tokens=then["batch_tokens"],
                              max_sentences=then["max_batch_sentences"], world_size=then["processes"])
        shard = int(earlier.shard_order(position.epoch)[position.shard_pos])
        lengths = self.corpus.shard_lengths(shard)
        if position.batch_pos >= len(earlier.my_batches(position.epoch, shard, lengths)):  # that shard is done
            position = (Position(position.epoch, position.shard_pos + 1) if position.shard_pos + 1 < self.corpus.n_shards
                        else Position(position.epoch + 1))
        at_epoch_start = position.shard_pos == 0 and position.batch_pos == 0
        if position.batch_pos == 0 and (at_epoch_start or "seed" not in changed):
            return position
        labels = {"seed": "--seed", "batch_tokens": "--batch-tokens", "max_batch_sentences": "--max-batch-sentences",
                  "processes": "processes"}
        options = ", ".join(f"{labels[name]} {then[name]} then, {self.batching()[name]} now" for name in changed)
        where = "epoch" if "seed" in changed else "shard"
        raise ValueError(f"the checkpoint's data position (epoch {position.epoch}, shard {position.shard_pos + 1} of "
                         f"{self.corpus.n_shards}, batch {position.batch_pos}) counts batches cut otherwise ({options}): "
                         f"the rest of the {where} would skip some sentences and train others twice; give the earlier "
                         f"values (a --max-steps can stop the run where the {where} ends), or continue from its model "
                         "in a new --output with --init")

    def fewest_batches_per_shard(self) -> list[int]:
        """A lower bound of each shard's `batches_per_shard` from the manifest alone, no shard read: a
        batch holds at most `max_sentences` sentences and max(batch_tokens, the longest window + 2)
        positions of tokens and boundaries (one sentence longer than batch_tokens is a batch of its own)."""
        widest = max(self.batch_tokens, self.corpus.manifest.max_sentence_tokens + 2)
        return [math.ceil(max(math.ceil((info.tokens + 2 * info.sentences) / widest),
                              math.ceil(info.sentences / self.max_sentences)) / self.world_size)
                for info in self.corpus.manifest.shards]

    def batches_per_shard(self) -> list[int]:
        """Exact count of each shard's batches for this process (reads every shard's ids once); the
        same in every epoch: another epoch's ties only reorder sentences of one length."""
        return [len(self.my_batches(0, shard, self.corpus.shard_lengths(shard)))
                for shard in range(self.corpus.n_shards)]

    def batches_left(self, per_shard: list[int], position: Position, epochs: int) -> int:
        """Of the counts `per_shard` (exact or the fewest), the batches this process reads from
        `position` to the end of `epochs`: a run resumed on another cut (--batch-tokens, processes)
        has as many steps left as this cut gives from there, not as a whole run of it."""
        if position.epoch >= epochs:
            return 0
        rest = [per_shard[int(shard)] for shard in self.shard_order(position.epoch)[position.shard_pos:]]
        this_epoch = max(0, rest[0] - position.batch_pos) + sum(rest[1:]) if rest else 0
        return this_epoch + (epochs - position.epoch - 1) * sum(per_shard)
