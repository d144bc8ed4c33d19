"""Whether batching changes this model's outputs: checked at start-up, on the
engine thread, from the model itself rather than a list of family names.

mlx-lm's BatchGenerator runs prompts of different lengths as one padded
batch. Most model families mask the padding; some let it run through their
recurrent state, so that rows shorter than the longest come out wrong with no
error, and some mask a batch wrongly or cannot run one at all. Before the
warm-up, the worker runs prompts of different lengths together and each
alone, in small chunks as serving prefills them, and compares each row with
its run alone twice:

- the state each layer holds once the row's prompt is prefilled (keys and
  values, recurrent state), relative to its size: padding run through a
  state shows here however little it moves the next token;
- the next-token distribution at each step while the row's tokens agree with
  the run alone: a decoding step that mixes up rows shows here.

Rounding differs between batch shapes (on a GPU in bfloat16, by a few parts
in a thousand); the tolerance is far above that and far below what a wrong
batch does. The worker serves in the first mode whose rows all match:

- batched: as configured;
- equal-lengths, prompts prefilled together only at equal lengths: mlx-lm pads the prompts
  of a prefill pass only where they have different lengths left, and a
  decoding step has no padding to run through a state. Checked twice:
  prompts of different lengths prefilled one at a time and decoded
  together, and prompts of one length prefilled together;
- one-at-a-time, one request at a time.

Rows run from the caches they will be served with: under --kv-bits, quantized
ones (whose padding is masked apart from the model's own caches'), compared
dequantized, a difference of one quantization step (a rounding either way)
counting as none; that verdict is remembered apart from the model's own caches'.

A model whose prompts cannot run even alone cannot be served: it is refused
(`types.Unservable`) before the worker reports SERVING.

Its verdict is remembered across restarts (`engine.batch_mode`): the check
runs once per model and machine. Prompts run alone only as the modes checked
need them, and a line says how far the check has come every few seconds: on
a slow device (a large model on a CPU) it takes a minute.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import QuantizedKVCache

from smg_mlx.engine.batch.sampling import batch_generator
from smg_mlx.engine.progress import Progress
from smg_mlx.engine.types import LayerCaches, Unservable
from smg_mlx.logs import error_line

log = logging.getLogger(__name__)


# Prompts of these lengths (different, so that the batch pads), prefilled in
# chunks of CHUNK tokens (several passes, as serving takes long prompts), then
# STEPS tokens each.
LENGTHS = (9, 37, 70, 150)
EQUAL = 3  # prompts of one length, in the equal-lengths mode's second run
CHUNK = 32
STEPS = 8
# How far a row may be from its run alone and still count as the same: its
# state after prefill (the largest difference over the largest value, per
# array) and its next-token distribution (total variation).
TOLERANCE = 0.05
# Part of the key of a remembered verdict (engine.batch_mode): a change to
# what the check runs or how it judges must change it, so that verdicts of
# the old check are not reused.
VERSION = "smg-mlx batch check 4"


class Mode(enum.Enum):
    """From the most batched to the least. The values are the names the worker
    reports (metrics, GetServerInfo), spelled as --batching's; what each means
    goes in the log (MEANINGS)."""

    BATCHED = "batched"
    EQUAL_LENGTHS = "equal-lengths"
    ONE_AT_A_TIME = "one-at-a-time"


# What a mode other than batched does, said where the log names it.
MEANINGS = {
    Mode.EQUAL_LENGTHS: "prompts prefill together only at equal lengths",
    Mode.ONE_AT_A_TIME: "requests run one at a time",
}


@dataclass(frozen=True)
class Choice:
    mode: Mode
    reason: str  # why not the modes before it (empty for batched)
    seconds: float  # what the check took (0: not run)
    basis: str  # what the choice rests on, for the log: "checked in 2.10s"
    checked: bool = True  # False: as --batching names it, never compared with prompts alone


@dataclass
class _Row:
    state: list[mx.array]  # its layers' arrays once its prompt was prefilled
    tokens: list[int]
    logprobs: list[mx.array]
    # For each of `state`'s arrays, a quantized one's step at each element (None: not quantized)
    steps: list[mx.array | None] = field(default_factory=list)


def _prompt(length: int, seed: int = 0) -> list[int]:
    """Token ids any vocabulary has, varied so that no two prompts share a prefix."""
    return [(i * 7919 + length * 104729 + seed * 31) % 256 + 1 for i in range(length)]


def _run(model: nn.Module, stream: mx.Stream, prompts: list[list[int]], prefill_rows: int,
         batch_size: int, progress: Progress,
         caches: LayerCaches | None) -> list[_Row]:  # fmt: skip
    """Greedy outputs of `prompts` run together under these limits, each from
    `caches()` (None: the model's own); one run more done, for `progress`."""
    generator = batch_generator(
        model, completion_batch_size=batch_size, prefill_batch_size=prefill_rows,
        prefill_step_size=CHUNK, stream=stream,
    )  # fmt: skip
    try:
        fresh = [caches() for _ in prompts] if caches is not None else None
        uids = generator.insert(prompts, max_tokens=[STEPS] * len(prompts), caches=fresh)
        rows = {uid: _Row([], [], []) for uid in uids}
        left = len(uids)
        while left:
            progress.tick()
            prefilled, generated = generator.next()
            # A prompt just prefilled is in the decoding rows, its first token
            # sampled but not yet run: its cache holds the prompt alone.
            ends = [r.uid for r in prefilled if r.end_of_prompt]
            for uid, (cache, _) in generator.extract_cache(ends).items():
                held = [_held(c) for c in cache]
                rows[uid].state = [a for arrays, _ in held for a in arrays]
                rows[uid].steps = [step for _, steps in held for step in steps]
                mx.eval(rows[uid].state, [step for step in rows[uid].steps if step is not None])
            for r in generated:
                rows[r.uid].tokens.append(r.token)
                rows[r.uid].logprobs.append(r.logprobs)
                left -= r.finish_reason is not None
        progress.advance()
        return [rows[uid] for uid in uids]
    finally:
        generator.close()


def _held(layer: object) -> tuple[list[mx.array], list[mx.array | None]]:
    """What a layer's cache holds, as numbers to compare, and each one's
    quantization step: a quantized one's keys and values dequantized (its
    packed words are not magnitudes), each element's step its group's scale."""
    if isinstance(layer, QuantizedKVCache):
        parts = layer.keys_and_values()
        values = [mx.dequantize(*q, group_size=layer.group_size, bits=layer.bits) for q in parts]
        # (mlx's scales may be negative)
        return values, [mx.repeat(mx.abs(q[1]), layer.group_size, axis=-1) for q in parts]
    arrays = _arrays(layer.state)
    return arrays, [None] * len(arrays)


def _arrays(value: object) -> list[mx.array]:
    """The arrays in a cache's state, in order."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


def _differs(row: _Row, alone: _Row) -> float:
    """How far `row` is from the same prompt run alone: the larger of its
    state's and its distributions' distances (see the module's doc)."""
    if [a.shape for a in row.state] != [a.shape for a in alone.state] or not alone.state:
        return 1.0
    state = max(
        (_gap(a, b, step_a, step_b).max() / mx.maximum(mx.abs(b).max(), 1e-6)).item()
        for a, b, step_a, step_b in zip(row.state, alone.state, row.steps, alone.steps,
                                        strict=True)
        if b.size
    )  # fmt: skip
    return max(state, _distance(row, alone))


def _gap(a: mx.array, b: mx.array, step_a: mx.array | None,
         step_b: mx.array | None) -> mx.array:  # fmt: skip
    """How far each element of `a` is from `b`'s, a quantized element's
    rounding (up to a step either way) not counted: a bfloat16 row's keys a
    hair apart may round to neighbouring steps, at 4 bits a tenth of their
    range."""
    gap = mx.abs(a - b)
    if step_a is None or step_b is None:
        return gap
    return mx.maximum(gap - mx.maximum(step_a, step_b), 0)


def _distance(row: _Row, alone: _Row) -> float:
    """The largest distance between the two rows' next-token distributions at
    the steps where they had been given the same tokens."""
    pairs = list(zip(row.tokens, row.logprobs, alone.tokens, alone.logprobs, strict=True))
    # A step's distribution depends on the tokens before it: up to the first
    # that differs, and that one's own step.
    same = next((i for i, (a, _, b, _) in enumerate(pairs) if a != b), len(pairs) - 1)
    pairs = [(a, b) for _, a, _, b in pairs[: same + 1]]
    if not pairs:
        return 1.0
    distances = [0.5 * mx.abs(mx.exp(a) - mx.exp(b)).sum() for a, b in pairs]
    return max(d.item() for d in distances)


def choose(model: nn.Module, stream: mx.Stream, prefill_rows: int, batch_size: int,
           caches: LayerCaches | None = None) -> Choice:  # fmt: skip
    """The first mode in which batching leaves the model's outputs as they are
    alone (see the module's doc), each row from `caches()` as served; raises
    Unservable if a prompt cannot run alone."""
    mixed = [_prompt(n) for n in LENGTHS]
    equal = [_prompt(LENGTHS[1], seed) for seed in range(1, EQUAL + 1)]
    # Counted from the first: the prompts alone, then together (a later mode,
    # tried only where batching changed outputs, adds its own runs).
    progress = Progress(log, "batch check", "runs", len(mixed) + (batch_size > 1))
    log.info(
        "batch check: running prompts of %s tokens together and each alone, to find whether "
        "batching changes this model's outputs", ", ".join(map(str, LENGTHS)),
    )  # fmt: skip
    alone: dict[tuple[int, ...], _Row] = {}
    _alone(model, stream, mixed, alone, progress, caches)
    runs = {
        Mode.BATCHED: [(mixed, prefill_rows)],
        Mode.EQUAL_LENGTHS: [(mixed, 1), (equal, prefill_rows)],
    }
    reasons = [] if batch_size > 1 else ["--completion-batch-size is 1"]
    for mode, checks in runs.items() if batch_size > 1 else ():
        prompts = [p for together, _ in checks for p in together]
        if mode is not Mode.BATCHED:
            progress.total += len(checks) + len({tuple(p) for p in prompts} - alone.keys())
        _alone(model, stream, prompts, alone, progress, caches)
        why = _mismatch(model, stream, checks, batch_size, alone, progress, caches)
        if why is None:
            return _checked(mode, reasons, progress)
        reasons.append(f"{mode.value}, {why}")
    return _checked(Mode.ONE_AT_A_TIME, reasons, progress)


def runs_alone(model: nn.Module, stream: mx.Stream, caches: LayerCaches | None = None) -> None:
    """Raise Unservable if one short prompt cannot run alone: what the check
    finds first, for a mode --batching names without it."""
    progress = Progress(log, "batch check", "runs", 1)
    _alone(model, stream, [_prompt(LENGTHS[0])], {}, progress, caches)


def _alone(model: nn.Module, stream: mx.Stream, prompts: list[list[int]],
           alone: dict[tuple[int, ...], _Row], progress: Progress,
           caches: LayerCaches | None) -> None:  # fmt: skip
    """Run each of `prompts` alone that has not run yet, into `alone`; raises
    Unservable if one cannot run."""
    try:
        for p in prompts:
            if tuple(p) not in alone:
                alone[tuple(p)] = _run(model, stream, [p], 1, 1, progress, caches)[0]
    except Exception as exc:  # noqa: BLE001 - the model's own fault, said in one line
        quantized = " with its KV cache quantized (leave out --kv-bits?)" if caches else ""
        raise Unservable(
            f"mlx-lm cannot generate with this model{quantized} even one prompt at a time "
            f"({error_line(exc)})"
        ) from exc


def _checked(mode: Mode, reasons: list[str], progress: Progress) -> Choice:
    seconds = progress.seconds
    return Choice(mode, because(mode, reasons), seconds, f"checked in {seconds:.2f}s")


def because(mode: Mode, reasons: list[str]) -> str:
    """A Choice's reason: what `mode` does and why it was chosen ("" for batched
    as configured)."""
    return f"{MEANINGS[mode]}, since {'; '.join(reasons)}" if reasons else ""


def _mismatch(model: nn.Module, stream: mx.Stream, checks: list[tuple[list[list[int]], int]],
              batch_size: int, alone: dict[tuple[int, ...], _Row],
              progress: Progress, caches: LayerCaches | None) -> str | None:  # fmt: skip
    """Why some prompt batched as `checks` says (prompts, prefill rows) comes
    out other than alone; None if none does."""
    for prompts, rows in checks:
        try:
            together = _run(model, stream, prompts, rows, batch_size, progress, caches)
        except Exception as exc:  # noqa: BLE001 - this mode cannot run: another may
            return f"it fails ({error_line(exc)})"
        pairs = zip(together, prompts, strict=True)
        worst = max(_differs(row, alone[tuple(p)]) for row, p in pairs)
        if worst > TOLERANCE:
            return f"its rows come out other than alone ({worst:.2f} apart)"
    return None
