"""The batch's rows: which request holds which place in which lane, and how
far each has come (engine thread).

The engine counts this itself, from what BatchGenerator returns, rather than
reading BatchGenerator's internals.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from smg_mlx.engine.memory.planner import Cost
from smg_mlx.engine.prefix_cache.memory_tier import Pace
from smg_mlx.engine.prefix_cache.token_tree import Entry
from smg_mlx.engine.schedule.scheduler import Running
from smg_mlx.engine.schedule.step_plan import LONG
from smg_mlx.engine.types import GenerationSpec, Request

Place = tuple[int, int]  # (lane, BatchGenerator uid)


@dataclass(slots=True)
class Row:
    """One request's place in the batch."""

    request: Request
    lane: int
    inserted: GenerationSpec  # what BatchGenerator runs (after an error: the rest of it)
    options: tuple  # its sampler, logits processors and stop sequences
    cached: int  # prompt tokens reused from the prefix cache (as its client is told)
    start: int  # tokens in its cache when it was inserted
    carries: Entry | None  # the prefix-cache entry whose whole key its row holds
    pace: Pace | None  # its conversation's turn (`prefix_cache.Start`)
    processed: int = 0  # prompt tokens prefilled since
    started: bool = False  # BatchGenerator has begun its prefill
    prefilling: bool = True  # its prompt is not all processed yet
    fresh: bool = True  # no token yet
    # Its first token went out in the pass that sampled it; mlx-lm returns
    # it a pass later, to be passed over then.
    ahead: bool = False
    generated: list[int] = field(default_factory=list)

    @property
    def key(self) -> int:
        return self.request.key

    @property
    def context(self) -> int:
        """Tokens in its cache."""
        return self.start + self.processed

    @property
    def decoded(self) -> int:
        """Tokens generated since it was inserted (after an error, its prompt
        holds those generated before)."""
        return len(self.generated) - len(self.inserted.prompt) + len(self.request.spec.prompt)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill, the last one aside."""
        return len(self.inserted.prompt) - 1 - self.context if self.prefilling else 0

    def ends_with(self, token: int) -> bool:
        """Whether `token`, sent next, ends the request: its last, or a stop token."""
        _, _, stop = self.options
        return len(self.generated) + 1 >= self.request.spec.max_tokens or stop.advance(token)


class Rows:
    """The rows admitted, by place and by request key, in admission order; and
    those put back after a failed step, until they are admitted again."""

    def __init__(self) -> None:
        self._rows: dict[Place, Row] = {}
        self._places: dict[int, Place] = {}  # request key -> place
        self.started = 0  # rows BatchGenerator is prefilling or decoding
        self._resuming: dict[int, Row] = {}  # key -> row of a request put back

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, place: Place) -> Row:
        return self._rows[place]

    def get(self, place: Place) -> Row | None:
        return self._rows.get(place)

    def places(self) -> list[Place]:
        return list(self._rows)

    def lanes(self) -> set[int]:
        """The lanes that hold a row."""
        return {lane for lane, _ in self._rows}

    def holds(self, key: int) -> bool:
        return key in self._places

    def place(self, key: int) -> Place:
        return self._places[key]

    def add(self, place: Place, row: Row) -> None:
        self._rows[place] = row
        self._places[row.key] = place

    def moved(self, place: Place, to: Place) -> None:
        """The row at `place` is at `to` now (put in again, as it started)."""
        row = self._rows.pop(place)
        self.add(to, row)

    def forget(self, place: Place) -> Row:
        row = self._rows.pop(place)
        del self._places[row.key]
        self.started -= row.started
        return row

    def prefilled(self, row: Row, processed: int, done: bool) -> None:
        """A pass prefilled the row's prompt up to `processed` tokens (`done`: all)."""
        self.started += not row.started
        row.started = True
        row.prefilling = not done
        row.processed = processed

    def prefilling(self) -> Iterator[Row]:
        """The rows whose prompt BatchGenerator has begun and not finished."""
        return (row for row in self._rows.values() if row.started and row.prefilling)

    def sequences(self, excluding: Iterable[int] = ()) -> list[Running]:
        """The admitted sequences (but those with the keys `excluding`), as the
        scheduler sees them."""
        leaving = set(excluding)
        # A request put back after an error prefills what it had generated too.
        return [
            Running(
                Cost(
                    len(row.inserted.prompt),
                    len(row.request.spec.prompt) + row.request.spec.max_tokens,
                    row.remaining + 1 if row.prefilling else 0,
                    row.lane == LONG,
                    row.decoded,
                ),
                row.remaining,
                row.context,
                row.key,
            )
            for row in self._rows.values()
            if row.key not in leaving
        ]

    def put_back(self, row: Row) -> None:
        """A row forgotten after a failed step, its request to be admitted again."""
        self._resuming[row.key] = row

    def resumed(self, key: int) -> Row | None:
        """The row put back for this request, if any (taken)."""
        return self._resuming.pop(key, None)

    def forget_resumed(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._resuming.pop(key, None)
