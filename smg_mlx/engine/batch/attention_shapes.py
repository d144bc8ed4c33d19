"""Prefill attention in few shapes, for mlx's CUDA backend (engine thread only).

There mlx runs prefill attention through cuDNN, which builds a graph for each
new set of query, key and mask shapes and strides: tens of milliseconds, more
than the attention of a few thousand tokens. A prompt that extends a cached
context starts and ends at lengths never seen before, so each one would build
two graphs or more before its first token. Here every prefill attention call
takes one of few shapes instead:

- **regular**: one row, causal, its queries within one window (an aligned
  span of the step plan's smallest or largest chunk length: the step plan
  cuts prompts so, and a short follow-up fits one too), or within the
  spanning window: the largest chunk and the smallest, ending on a multiple
  of the smallest, which holds a prompt's last piece of up to a chunk
  wherever it starts (the step plan prefills that in one pass rather than
  two). Keys and values are padded at the end to the window's end, queries
  at the end by as many and in front to the window's length: causal
  attention lines the last query up with the last key, so each real query
  sees what it saw, and the call runs causal as a full chunk at the window's
  end: one shape per window and end, whatever the lengths. Its inputs are
  made contiguous: the graph is keyed by their strides too, and the keys'
  would follow the cache buffer's spare room.
- **bucketed**: any other call (several rows, which come with a mask array).
  Queries are padded to a power of two (at least QUERY_BUCKET), keys and
  values to the next key bucket, and an additive mask gives each real query
  what it saw and hides the padding. Masked attention costs more than causal
  attention of the same shapes: only what cannot run causal runs so.
The padded rows of the output are dropped.

A call of a few queries a row (`FEW_QUERIES`: a pass checking speculative
proposals, or a few rows' short follow-ups) runs as plain matrix products
instead: it reads each row's keys once, as a decoding step does, and cuDNN
would build a graph for each new key length, which such passes meet at
every step.

The padded copies cost memory, those of the layers in flight (a long pass
goes to the device a layer at a time: `layer_waits`): `working_set` says how
much, for the memory planner, where every prefill attention runs so.

`queue` (at start-up) lists the regular shapes up to the model's context and
the smallest key bucket for several rows, and the engine builds them while
it has nothing to run (`build_queued`), after the worker reports ready: they
take seconds. What is still new is built on first use, and the step plan
counts the build where `builds` says so.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import mlx.core as mx

from smg_mlx.config import MOST_DRAFT_TOKENS
from smg_mlx.engine.batch.layer_waits import LayerWaits, copies_per_key
from smg_mlx.engine.progress import Progress
from smg_mlx.engine.schedule.step_plan import SHAPE_BUILD_STEP_TOKENS

log = logging.getLogger(__name__)

QUERY_BUCKET = 256  # the smallest query bucket
# Queries a row at most that run as plain matrix products: a pass checking
# the most proposals --num-draft-tokens allows, and its pending token.
FEW_QUERIES = MOST_DRAFT_TOKENS + 1
# A window between the smallest and the largest chunk: a follow-up's new
# tokens, or a chunk of a prompt beside others, run in it rather than padded
# to the largest chunk.
MIDDLE_WINDOW = 2048
KEY_BUCKET = 4096  # key buckets are multiples of this, or of an eighth of the length's power of two
# The warm-up builds shapes up to the model's context, or this (later ones on first use).
PREBUILT_CONTEXT = 65536
# Past this many shapes (engine.batch.loading sizes mlx's graph cache to hold as
# many) what is remembered as built starts over.
SHAPES_REMEMBERED = 1024

# Bytes a prefill pass of several rows holds per row, query and key: mlx-lm's
# boolean mask, padded, and the additive mask made from it.
MASK_BYTES = 4

# rows, queries, keys and whether it is regular (causal as it is) or bucketed
Key = tuple[int, int, int, bool]

# heads, kv heads, key and value head sizes, dtype
Geometry = tuple[int, int, int, int, Any]


def shapes_build() -> bool:
    """Whether each new attention shape costs a kernel build here (mlx's CUDA backend)."""
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


def round_up(n: int, step: int) -> int:
    """The least multiple of `step` that is at least `n`."""
    return -(-n // step) * step


class Window(NamedTuple):
    """A regular window: its queries, and the multiple its keys end on."""

    queries: int
    step: int

    def ends(self, context: int) -> range:
        """The key lengths it runs at, up to `context` and the window past it."""
        return range(round_up(self.queries, self.step), context + self.step, self.step)


def query_bucket(n: int) -> int:
    """The padded query length for `n` queries."""
    return max(QUERY_BUCKET, 1 << (n - 1).bit_length())


def key_bucket(n: int) -> int:
    """The padded key length for `n` keys (at most an eighth more past 32k)."""
    step = max(KEY_BUCKET, (1 << (n - 1).bit_length()) // 8)
    return round_up(n, step)


def windows_for(max_chunk: int) -> tuple[Window, ...]:
    """The regular windows, fewest queries first, for prefill chunks of at
    most `max_chunk`: the smallest chunk the step plan gives one row where
    shapes cost builds, MIDDLE_WINDOW, its largest power-of-two one, and the
    spanning window (the largest and the smallest, on the smallest's grid;
    none where the chunk is that small: its shapes would pass the graphs kept,
    SHAPES_REMEMBERED)."""
    largest = 1 << (max_chunk.bit_length() - 1)
    wanted = (SHAPE_BUILD_STEP_TOKENS, MIDDLE_WINDOW, largest)
    sizes = sorted({min(size, largest) for size in wanted})
    spanning = [Window(largest + sizes[0], sizes[0])] if len(sizes) > 1 else []
    return (*(Window(size, size) for size in sizes), *spanning)


def shape_key(rows: int, queries: int, keys: int, causal: bool, windows: Sequence[Window]) -> Key:
    """The shape a prefill attention call runs in: regular in the first of
    `windows` that holds all its queries, else bucketed."""
    if rows == 1 and causal:
        for window in windows:
            end = round_up(keys, window.step)
            if queries + end - keys <= window.queries <= end:
                return (rows, window.queries, end, True)
    return (rows, query_bucket(queries), key_bucket(keys), False)


def _supported(q: mx.array, v: mx.array) -> bool:
    """Whether mlx would run this prefill through cuDNN (else nothing is built)."""
    sizes_ok = all(d % 8 == 0 and d <= 128 for d in (q.shape[-1], v.shape[-1]))
    return q.shape[2] > 1 and q.dtype in (mx.bfloat16, mx.float16) and sizes_ok


def attend_few(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention as matrix products, for a few queries a row (boolean or additive mask)."""
    rows, heads, queries, size = q.shape
    groups = heads // k.shape[1]  # query heads sharing a key head
    q = (q * scale).reshape(rows, k.shape[1], groups, queries, size)
    scores = (q @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)
    if mask is not None:
        mask = mask[:, :, None] if mask.ndim == 4 else mask
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -mx.inf)
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1).astype(v.dtype)
    return (weights @ v[:, :, None]).reshape(rows, heads, queries, v.shape[-1])


def _whole(x: mx.array) -> mx.array:
    return x


def _pad_keys(x: Any, extra: int) -> Any:
    """`x` (an array, or a quantized array's parts) with `extra` keys at the end."""
    if not isinstance(x, mx.array):
        return [_pad_keys(part, extra) for part in x]
    return mx.pad(x, [(0, 0), (0, 0), (0, extra), (0, 0)]) if extra else x


class AttentionShapes:
    """Wraps mlx's fused attention so that prefills run in few shapes, and
    remembers which have been built."""

    def __init__(self, max_chunk: int) -> None:
        self.max_chunk = max_chunk  # the longest prefill chunk
        self.windows = windows_for(max_chunk)
        self._fused: Callable[..., mx.array] | None = None
        self._built: set[Key] = set()
        self._geometries: set[Geometry] = set()
        self._bias: tuple[tuple, mx.array] | None = None  # the last mask built, for the next layers
        self._waits = LayerWaits()
        self.unpadded = False  # whether a prefill ran mlx's own attention (see working_set)
        self._queued: deque[tuple[Geometry, Key]] = deque()  # shapes to build while idle
        self._progress = Progress(log, "attention shapes", "built", 0)
        self._context = 0

    def install(self) -> None:
        """Route mlx's fused attention through this (models call it by module attribute)."""
        self._fused = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = self.attention

    def uninstall(self) -> None:
        if self._fused is not None:
            mx.fast.scaled_dot_product_attention = self._fused
            self._fused = None

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """mlx's own attention while inside."""
        self.uninstall()
        try:
            yield
        finally:
            self.install()

    def builds(self, rows: int, queries: int, context: int) -> bool:
        """Whether a pass prefilling `queries` tokens a row for `rows` rows
        after `context` would build a graph first."""
        key = shape_key(rows, queries, context + queries, rows == 1, self.windows)
        return key not in self._built

    def attended(self, rows: int, queries: int, context: int) -> int:
        """The queries a row of such a pass runs attention for, padding included."""
        return shape_key(rows, queries, context + queries, rows == 1, self.windows)[1]

    def forget(self) -> None:
        """A step ended: the mask kept for its layers is not needed."""
        self._bias = None

    @property
    def installed(self) -> bool:
        """Whether mlx's fused attention runs through this now (not `bypassed`)."""
        return self._fused is not None

    def attention(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                  mask: Any = None, **rest: Any) -> mx.array:  # fmt: skip
        fused = self._fused
        if q.shape[2] == 1:  # a decoding step, every layer: nothing to pad, and first
            return fused(q, k, v, scale=scale, mask=mask, **rest)
        if any(value is not None for value in rest.values()) or not _supported(q, v):
            self.unpadded = True
            return fused(q, k, v, scale=scale, mask=mask, **rest)
        if q.shape[2] <= FEW_QUERIES and not isinstance(mask, str):
            return attend_few(q, k, v, scale, mask)
        return self.prefill(q, k, v, scale, mask)

    def prefill(self, q: mx.array, k: Any, v: Any, scale: float, mask: Any,
                dequantize: Callable[[Any], mx.array] | None = None) -> mx.array:  # fmt: skip
        """A prefill pass's attention, in its shape. Quantized keys and values
        (`engine.batch.quantized_attention`) come with `dequantize`: they are
        padded while quantized, so that the padded copy is the only full-size one."""
        fused = self._fused
        whole = _whole if dequantize is None else dequantize
        rows, queries = q.shape[0], q.shape[2]
        keys = (k if isinstance(k, mx.array) else k[0]).shape[2]
        causal = isinstance(mask, str)
        key = shape_key(rows, queries, keys, causal, self.windows)
        _, tq, tk, regular = key
        # Lazy: neither copy is made unless used.
        padded_k, padded_v = (whole(_pad_keys(x, tk - keys)) for x in (k, v))
        if not _supported(q, padded_v):
            self.unpadded = True
            out = fused(q, whole(k), whole(v), scale=scale, mask=mask)
            return self._waits.after(out, rows * keys)
        self._geometries.add(
            (q.shape[1], padded_k.shape[1], q.shape[-1], padded_v.shape[-1], q.dtype)
        )
        self._remember(key)
        # Keys and values padded at the end; queries at the end by as many
        # (a regular chunk also in front, to a full chunk).
        after = tk - keys if regular else tq - queries
        before = tq - queries - after
        q = mx.pad(q, [(0, 0), (0, 0), (before, after), (0, 0)])
        q, k, v = mx.contiguous(q), mx.contiguous(padded_k), mx.contiguous(padded_v)
        if regular:
            out = fused(q, k, v, scale=scale, mask=mask)[:, :, before : before + queries]
        else:
            bias = self._padded_mask(mask, queries, keys, tq, tk, q.dtype)
            out = fused(q, k, v, scale=scale, mask=bias)[:, :, :queries]
        return self._waits.after(out, rows * tk)

    def working_set(self, kv_per_token: float, layers: int) -> tuple[float, float] | None:
        """What a prefill pass's attention holds, per prompt row, where every
        prefill so far ran through here: bytes per query and key (the masks of
        several rows; cuDNN's fused attention keeps no scores), and per key (the
        padded keys and values, `kv_per_token` over all `layers`, of the layers
        in flight: `layer_waits`). None where some prefill ran mlx's own
        attention: then what it holds is measured (`engine.memory.probe`)."""
        return None if self.unpadded else (MASK_BYTES, copies_per_key(kv_per_token, layers))

    def _remember(self, key: Key) -> None:
        if key not in self._built and len(self._built) >= SHAPES_REMEMBERED:
            self._built.clear()
        self._built.add(key)

    def _padded_mask(self, mask: Any, queries: int, keys: int, tq: int, tk: int,
                     dtype: Any) -> mx.array:  # fmt: skip
        """An additive mask of `tq` x `tk`: each real query sees what `mask` let
        it see, no real query sees a padded key, and padded queries see every
        key (their rows are dropped; a row seeing nothing would be NaN)."""
        # Every layer of a pass gets the same mask: built once a pass. Holding
        # the mask itself keeps its id from being reused while remembered.
        memo = (mask if not isinstance(mask, mx.array) else id(mask), queries, keys, tq, tk, dtype)
        if self._bias is not None and self._bias[0][0] == memo:
            return self._bias[1]
        rows = mx.arange(tq)[:, None]
        cols = mx.arange(tk)[None, :]
        zero, hidden = mx.array(0, dtype), mx.array(-float("inf"), dtype)
        if mask is None or isinstance(mask, str):
            # causal: query i is token keys - queries + i
            seen = cols < keys if mask is None else cols <= rows + (keys - queries)
            additive = mx.where(seen, zero, hidden)[None, None]
        else:
            widths = [(0, 0)] * (mask.ndim - 2) + [(0, tq - queries), (0, tk - keys)]
            if mask.dtype == mx.bool_:
                additive = mx.where(mx.pad(mask, widths), zero, hidden)
            else:
                additive = mx.pad(mask, widths, constant_values=-float("inf")).astype(dtype)
        bias = mx.where(rows >= queries, zero, additive)
        self._bias = ((memo, mask), bias)
        return bias

    def queue(self, context: int, prefill_rows: int) -> None:
        """Queue, for every attention geometry the model has run, the regular
        shapes up to `context` tokens (at most PREBUILT_CONTEXT) and the
        smallest key bucket for up to `prefill_rows` rows: `build_queued`
        builds them (the engine, while it has nothing to run)."""
        context = min(context, PREBUILT_CONTEXT)
        queries = [QUERY_BUCKET]
        while queries[-1] < query_bucket(self.max_chunk):
            queries.append(queries[-1] * 2)
        shapes = [(1, window.queries, end, True) for window in self.windows
                  for end in window.ends(context)]  # fmt: skip
        shapes += [(rows, tq, key_bucket(1), False)
                   for rows in range(2, prefill_rows + 1) for tq in queries]  # fmt: skip
        todo = [shape for shape in shapes if shape not in self._built]
        geometries = sorted(self._geometries, key=str)
        self._queued = deque((geometry, shape) for geometry in geometries for shape in todo)
        self._progress = Progress(log, "attention shapes", "built", len(self._queued))
        self._context = context
        if self._queued:
            log.info(
                "attention shapes: building %d for prompts up to %d tokens while idle (a "
                "prompt that meets one not built yet builds it first)", len(self._queued), context,
            )  # fmt: skip

    @property
    def queued(self) -> bool:
        """Whether shapes wait in the queue (`queue`)."""
        return bool(self._queued)

    def build_queued(self, seconds: float) -> None:
        """Build queued shapes for about `seconds` (at least one)."""
        if not self._queued:
            return
        deadline = time.monotonic() + seconds
        while self._queued:
            geometry, shape = self._queued.popleft()
            if shape not in self._built:  # a prompt may have built it first
                self._build(geometry, *shape)
            self._progress.advance()
            if time.monotonic() >= deadline:
                break
        self.forget()
        if not self._queued:
            log.info(
                "attention shapes for prompts up to %d tokens: %d built in %.1fs",
                self._context, self._progress.done, self._progress.seconds,
            )  # fmt: skip

    def _build(self, geometry: Geometry, rows: int, tq: int, tk: int, regular: bool) -> None:
        heads, kv_heads, dk, dv, dtype = geometry
        q = mx.zeros((rows, heads, tq, dk), dtype)
        k = mx.zeros((rows, kv_heads, tk, dk), dtype)
        v = mx.zeros((rows, kv_heads, tk, dv), dtype)
        # One row's calls are causal; several rows' come with mlx-lm's mask array.
        mask: Any = "causal" if regular else mx.ones((rows, 1, tq, tk), mx.bool_)
        mx.eval(self.attention(q, k, v, scale=1.0, mask=mask))
