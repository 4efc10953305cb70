"""A bounded least-recently-used cache of context-free token representations.

The token layer depends only on the word, so a word's vector can be computed once and
reused. Values live in one (rows, P) tensor on the model's device, grown by doubling as words
are kept, up to the capacity (memory follows the words cached, not the capacity asked for); the
dict holds slots, so a batch's hits are served by a single index_select.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence

import torch


# Longer words are computed at every use, never kept: a key is the whole word, and extract's
# tokens run to 131,072 characters, so keys of any length would let a full cache hold gigabytes.
MAX_CACHED_CHARS = 256


class WordCache:
    """Safe to share between threads: the bookkeeping runs under one lock, the encoder outside
    it. A lookup copies the rows it hits while it holds the lock, so another thread's eviction
    can never hand it a slot that has since been given to another word."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self.clear()

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickling, torch.save of the model, SWA's AveragedModel) starts empty,
        with a lock of its own: a lock cannot be copied, and the table is recomputed on demand."""
        return {"capacity": self.capacity}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["capacity"])

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self.slots: OrderedDict[str, int] = OrderedDict()  # word -> row of table, oldest first
        self.free: list[int] = []  # rows given back by evictions
        self.unused = 0  # rows from here on were never given: no list of them (a capacity of 3e7 cost 2.3 GB)
        self.table: torch.Tensor | None = None
        self.key: tuple | None = None  # (device, dtype, autocast) the table was filled under

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(
        self, words: Sequence[str], compute: Callable[[list[str]], torch.Tensor], key: tuple,
    ) -> torch.Tensor:
        """(len(words), P) representations of distinct `words`; `compute` runs on the misses only."""
        if len(words) > self.capacity:
            with self._lock:
                self.misses += len(words)
            return compute(list(words))
        with self._lock:
            if key != self.key:
                self._clear()
                self.key = key
            hit_rows, hit_slots, missing_rows, missing = [], [], [], []
            for row, w in enumerate(words):
                slot = self.slots.get(w)
                if slot is None:
                    missing_rows.append(row)
                    missing.append(w)
                else:
                    self.slots.move_to_end(w)
                    hit_rows.append(row)
                    hit_slots.append(slot)
            self.hits += len(hit_rows)
            self.misses += len(missing)
            hit_values = None
            if hit_rows:
                assert self.table is not None
                hit_values = self.table.index_select(0, torch.tensor(hit_slots, device=self.table.device))
        if not missing:
            assert hit_values is not None
            return hit_values
        values = compute(missing)
        with self._lock:
            if key == self.key:  # else another thread switched the table to another key meanwhile
                self._store(missing, values)
        if hit_values is None:
            return values
        out = values.new_empty(len(words), values.shape[1])
        out.index_copy_(0, torch.tensor(missing_rows, device=out.device), values)
        out.index_copy_(0, torch.tensor(hit_rows, device=out.device), hit_values)
        return out

    def _store(self, words: list[str], values: torch.Tensor) -> None:
        """Under the lock: add the rows of `values` for `words` that no other thread added meanwhile."""
        new = [(row, w) for row, w in enumerate(words) if w not in self.slots and len(w) <= MAX_CACHED_CHARS]
        if not new:
            return
        while len(self.free) + self.capacity - self.unused < len(new):
            _, slot = self.slots.popitem(last=False)  # the least recently used
            self.free.append(slot)
        slots = [self.free.pop() for _ in range(min(len(self.free), len(new)))]
        fresh = len(new) - len(slots)
        slots += range(self.unused, self.unused + fresh)
        self.unused += fresh
        self._reserve(self.unused, values)
        if len(new) < len(words):
            values = values.index_select(0, torch.tensor([row for row, _ in new], device=values.device))
        self.table.index_copy_(0, torch.tensor(slots, device=self.table.device), values.to(self.table.dtype))
        self.slots.update(zip((w for _, w in new), slots))

    def _reserve(self, rows: int, values: torch.Tensor) -> None:
        """Under the lock: a table of at least `rows` rows, doubled as it fills, at most the capacity."""
        have = 0 if self.table is None else self.table.shape[0]
        if rows <= have:
            return
        like = values if self.table is None else self.table
        grown = like.new_empty(min(self.capacity, max(rows, 2 * have, 1024)), values.shape[1])
        if self.table is not None:
            grown[:have].copy_(self.table)
        self.table = grown
