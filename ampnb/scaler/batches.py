"""The stepper's data: any iterable of batches, read lazily and cycled when exhausted."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ampnb.batch import ALLOWED


class BatchCycle:
    """Batch i of an iterable: lists are indexed, other iterables read on demand and kept."""

    def __init__(self, batches: Iterable[Any]) -> None:
        if not isinstance(batches, Iterable) or isinstance(batches, (str, bytes)):
            raise ValueError(f"batches={type(batches).__name__} is not allowed; allowed: an "
                             f"iterable of batches (a list, a DataLoader, a generator), each "
                             f"{ALLOWED}.")
        # A generator (or a DataLoader) may be endless, so it is read one batch at a time; the
        # batches read are kept so that the cycle, reset() and load_state_dict() repeat them.
        self.seen: list[Any] = list(batches) if isinstance(batches, Sequence) else []
        self._rest: Iterator[Any] | None = None if isinstance(batches, Sequence) else iter(batches)

    @property
    def exhausted(self) -> bool:
        """True once every batch has been read (the cycle length is known)."""
        return self._rest is None

    def __getitem__(self, index: int) -> Any:
        while self._rest is not None and len(self.seen) <= index:
            try:
                # One line: no line for an interrupt to fall on between reading and keeping a
                # batch. Not held back: a slow or stuck DataLoader must stay interruptible.
                self.seen.append(next(self._rest))
            except StopIteration:
                self._rest = None
        if not self.seen:
            raise ValueError(f"batches is empty; allowed: at least one batch, {ALLOWED}.")
        return self.seen[index % len(self.seen)]
