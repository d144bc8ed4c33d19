"""The warm-up: what serving does, done once before the worker says it is ready
(runs on the engine thread, through the batch's own paths).

mlx builds some kernels the first time it meets them. On its CUDA backend a
kernel it compiles costs seconds, once per host (they are kept on disk, under
MLX_PTX_CACHE_DIR; `engine.batch.sampling` says how few there are), and a
new attention variant a little (cuDNN): a request that meets one first
stalls every stream for that long.
So on such a backend the warm-up runs each kind of step serving runs:
prompts alone and batched (with padding and without), decoding past 256
tokens of cache (where the cache first grows), rows joining and leaving a
running batch, sampling with every filter, penalties, logit bias and
logprobs, a long prompt prefilling in its lane, several chunks a step,
while a short one starts in the other, and, where speculative decoding is
on, the passes it adds (`SpeculativeGenerationBatch.exercise`); then, under
--kv-bits, passes of every few-query count over quantized caches
(`engine.batch.quantized_attention`), and it queues the attention shapes
prompts up to the model's context meet (`engine.batch.attention_shapes`).
Elsewhere one short generation is enough. Nothing of it stays: the batch is
empty afterwards, its prefix cache too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from smg_mlx.engine.progress import Progress
from smg_mlx.engine.types import GenerationSpec, LogitsSettings, Request, SamplingSettings

if TYPE_CHECKING:
    from smg_mlx.engine.batch.batch import Batch

log = logging.getLogger(__name__)

GREEDY = SamplingSettings(temperature=0.0)
SAMPLED = SamplingSettings(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1)
PLAIN = LogitsSettings()
PENALISED = LogitsSettings(
    repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1, logit_bias=((1, 2.0),)
)
CHUNK = 512  # the long prompt's prefill chunk


def prompt(length: int) -> tuple[int, ...]:
    """A warm-up prompt of `length` tokens (ids any vocabulary has: what they are
    does not matter, only how many)."""
    return tuple((i * 7 + length) % 32 + 1 for i in range(length))


class _Script:
    """Warm-up requests on a batch (keys below zero: no client's), run to their end."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.keys = 0
        self.running: set[int] = set()
        self.progress = Progress(log, "warm-up", "requests run")

    def request(
        self,
        length: int,
        max_tokens: int,
        sampling: SamplingSettings = GREEDY,
        logits: LogitsSettings = PLAIN,
        logprobs: int | None = None,
    ) -> Request:
        self.keys -= 1
        spec = GenerationSpec(prompt(length), max_tokens, frozenset(), sampling, logits, logprobs)
        return Request(self.keys, spec, "warm-up")

    def start(self, *requests: Request, long: bool = False) -> set[int]:
        """Admit `requests` (to the long prompts' lane with `long`)."""
        failed = self.batch.admit(list(requests), [r.key for r in requests] if long else ())
        if failed:
            raise RuntimeError(f"the warm-up could not start a request: {failed[0].error}")
        log.debug(
            "warm-up: prompts of %s tokens start at %.1fs",
            [len(r.spec.prompt) for r in requests], self.progress.seconds,
        )  # fmt: skip
        keys = {r.key for r in requests}
        self.running |= keys
        return keys

    def step(self, *long_chunks: int) -> None:
        """One step, as the engine loop runs it."""
        self._ran(self.batch.step(CHUNK, long_chunks)[0])

    def exercise_speculation(self) -> None:
        """Each kind of pass speculative decoding adds, on the rows decoding now."""
        self._ran(self.batch.exercise_speculation())

    def _ran(self, events: list) -> None:
        """What ended keeps; those requests run no more."""
        self.batch.keep_ended()
        for event in events:
            if event.ends:
                self.running.discard(event.key)
                self.progress.done += 1

    def until(self, keys: Iterable[int]) -> None:
        """Step until these requests end."""
        keys = set(keys)
        while keys & self.running:
            self.progress.tick()
            self.step()


def run(batch: Batch, thorough: bool) -> None:
    """Warm `batch` up; `thorough`: every kind of step (see the module's doc)."""
    script = _Script(batch)
    if thorough:
        _every_kind_of_step(script)
    else:
        script.until(script.start(script.request(4, 2)))
    # Its entries are no client's: kept, they would only count in the metrics,
    # as its proposals would (its prompts recur: each proposes what the last said).
    batch.drop_cached(batch.cached_over(0)[0])
    batch.uncount_speculation()
    log.info(
        "warm-up: %s, in %.1fs", "every kind of step ran" if thorough else "one short request ran",
        script.progress.seconds,
    )  # fmt: skip
    if thorough:
        batch.build_quantized_kernels()
        batch.queue_attention_shapes()


def _every_kind_of_step(script: _Script) -> None:
    log.info(
        "warm-up: running every kind of step once (a first start on this host builds "
        "mlx's kernels, seconds each)"
    )
    # Unequal prompts batched (a padding mask), each sampled another way; the
    # first goes on decoding while the others leave the batch.
    first = script.request(300, 12)
    script.until(
        script.start(
            first,
            script.request(40, 3, SAMPLED, logprobs=5),
            script.request(100, 2, logits=PENALISED, logprobs=0),
        )
        - {first.key}
    )
    script.until(script.start(script.request(63, 2)))  # joins a running batch
    script.until(script.start(script.request(300, 2), script.request(300, 2)) | {first.key})
    script.start(script.request(4 * CHUNK + 5, 2), long=True)
    script.step(CHUNK)
    script.start(script.request(20, 2))
    script.step(CHUNK, CHUNK)
    script.until(script.running)
    script.until(script.start(script.request(300, 2)))  # a batch of one
    # Proposals checked (speculative decoding), greedy and sampled rows together,
    # beside the place a row that ended left: rows then run through their places
    # (`row_places`), and chained passes route what they take back there.
    rows = script.start(
        script.request(40, 24), script.request(50, 24, SAMPLED), script.request(30, 1)
    )
    script.step()
    script.step()
    script.exercise_speculation()
    script.until(rows)
