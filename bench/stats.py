"""Per-request measurements and the per-level numbers the report shows.

Inter-token latency (ITL) is counted per token gap, not per chunk. A streamed
chunk can carry several tokens (a worker sends whatever piled up since its last
chunk); a chunk of k tokens arriving `gap` seconds after the previous chunk
contributes k samples of gap/k. Tokens that share the first chunk with the
first token contribute samples of 0 (they did arrive together). So the mean
ITL always equals (last arrival - first arrival) / (tokens - 1), whatever the
chunking, while the percentiles still show stalls. `tokens_per_chunk` shows
how much chunking happened.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """One request's timeline, in seconds from its own start."""

    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    chunks: int = 0
    last: float | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens the worker reported as served from its cache
    output_ids: list[int] | None = None  # kept only when asked for
    index: int | None = None  # the workload's prompt it sent, where a closed loop sent it

    @property
    def stream_rate(self) -> float | None:
        """Its tokens a second after its first (None: too few tokens to tell)."""
        if self.ttft is None or self.last is None or self.last <= self.ttft:
            return None
        return (self.tokens - 1) / (self.last - self.ttft)

    def arrived(self, at: float, count: int) -> None:
        """`count` tokens arrived together at time `at`."""
        if count <= 0:
            return
        if self.last is None:
            self.ttft = at
            self.itl.extend([0.0] * (count - 1))
        else:
            self.itl.extend([(at - self.last) / count] * count)
        self.last = at
        self.tokens += count
        self.chunks += 1


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linearly interpolated; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LevelResult:
    system: str
    concurrency: int
    requests: int
    errors: int
    tokens: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_mean_ms: float
    tokens_per_chunk: float
    first_error: str | None = None
    # Each round's tok/s on its own (rounds of one level are pooled above).
    round_tok_s: tuple[float, ...] = ()

    @property
    def best_tok_s(self) -> float:
        """The fastest round's tok/s: what the system does when nothing else
        on the machine slows it (interference only ever slows a round)."""
        return max(self.round_tok_s, default=self.tok_s)

    def to_dict(self) -> dict:
        return asdict(self)

    def brief(self) -> str:
        """One progress line."""
        return (
            f"{self.system} c={self.concurrency}: {self.tok_s:.0f} tok/s, "
            f"TTFT p50 {self.ttft_p50_ms:.1f} ms, ITL p50 {self.itl_p50_ms:.2f} ms, "
            f"{self.errors} errors"
        )


def summarize(
    system: str,
    concurrency: int,
    records: list[RequestRecord],
    wall_s: float,
    round_tok_s: tuple[float, ...] = (),
) -> LevelResult:
    """Numbers for one level; tokens/s counts every generated token in the timed window."""
    ok = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itl = [gap for r in ok for gap in r.itl]
    tokens = sum(r.tokens for r in records)
    chunks = sum(r.chunks for r in ok)
    return LevelResult(
        system=system,
        concurrency=concurrency,
        requests=len(records),
        errors=len(failed),
        tokens=tokens,
        wall_s=wall_s,
        tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50) * 1e3,
        ttft_p99_ms=percentile(ttfts, 99) * 1e3,
        itl_p50_ms=percentile(itl, 50) * 1e3,
        itl_p99_ms=percentile(itl, 99) * 1e3,
        itl_mean_ms=(sum(itl) / len(itl) * 1e3) if itl else float("nan"),
        tokens_per_chunk=sum(r.tokens for r in ok) / chunks if chunks else float("nan"),
        first_error=failed[0].error if failed else None,
        round_tok_s=round_tok_s,
    )
