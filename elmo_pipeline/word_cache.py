"""A bounded least-recently-used cache of context-free token representations.

The token layer depends only on the word, so a word's vector can be computed once and
reused. Values live in one preallocated (capacity, P) tensor on the model's device; the
dict holds slots, so a batch is served by a single index_select.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch


class WordCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self.clear()

    def clear(self) -> None:
        self.slots: OrderedDict[str, int] = OrderedDict()  # word -> row of table, oldest first
        self.free = list(range(self.capacity - 1, -1, -1))
        self.table: torch.Tensor | None = None
        self.key: tuple | None = None  # (device, dtype, autocast) the table was filled under

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(
        self, words: Sequence[str], compute: Callable[[list[str]], torch.Tensor], key: tuple,
    ) -> torch.Tensor:
        """(len(words), P) representations of distinct `words`; `compute` runs on the misses only."""
        if len(words) > self.capacity:
            self.misses += len(words)
            return compute(list(words))
        if key != self.key:
            self.clear()
            self.key = key
        missing = [w for w in words if w not in self.slots]
        self.hits += len(words) - len(missing)
        self.misses += len(missing)
        for w in words:
            if w in self.slots:
                self.slots.move_to_end(w)
        if missing:
            values = compute(missing)
            if self.table is None:
                self.table = values.new_empty(self.capacity, values.shape[1])
            while len(self.free) < len(missing):
                # the oldest entries are not in this batch: every hit was just moved to the end
                _, slot = self.slots.popitem(last=False)
                self.free.append(slot)
            new_slots = [self.free.pop() for _ in missing]
            index = torch.tensor(new_slots, device=self.table.device)
            self.table.index_copy_(0, index, values.to(self.table.dtype))
            self.slots.update(zip(missing, new_slots))
        assert self.table is not None
        index = torch.tensor([self.slots[w] for w in words], device=self.table.device)
        return self.table.index_select(0, index)
