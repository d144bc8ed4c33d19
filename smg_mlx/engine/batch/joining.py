"""Prompts joining the decoding rows without a pass of their own (engine thread only).

mlx-lm prefills a prompt but for its last token. The call after, it moves the
row into the decoding rows by running a pass over the rows joining alone: one
token each, whose samples are their first tokens. That pass costs about what
a pass over every decoding row costs (the weights are read either way), and
every running stream waits for it. Where requests join one or two at a time
(answers of different lengths; speculative decoding, whose rows finish apart)
it is nearly one pass more for each request.

Here the rows whose prompts have only their last token left join the decoding
rows at the end of the call that prefilled the rest, that token as their
pending input (`EndingGenerationBatch.join`). The next call's pass runs it
beside every other row's, samples their first tokens and returns nothing for
them; that call reports their prompts finished, as mlx-lm's would have. Their
first tokens come after as many passes as before, none of them theirs alone.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch


def join_ready(generator: BatchGenerator) -> list[PromptProcessingBatch.Response]:
    """Move the generator's rows whose prompts have only their last token left
    into its decoding rows, that token still to run (see the module doc): the
    responses that say their prompts ended, to be given once a pass ran it."""
    processing = generator._currently_processing  # mlx-lm's: [segments, done, total] a row
    ready = [i for i, (segments, *_) in enumerate(processing)
             if len(segments) == 1 and len(segments[0]) == 1]  # fmt: skip
    if not ready:
        return []
    last = [processing[i][0][0][0] for i in ready]
    totals = [processing[i][2] for i in ready]
    generator._currently_processing = [p for i, p in enumerate(processing) if i not in ready]
    rows = _not_stepped(generator._prompt_batch.split(ready), last)
    generator._generation_batch.join(rows)
    return [
        PromptProcessingBatch.Response(uid, (total, total), True, True)
        for uid, total in zip(rows.uids, totals, strict=True)
    ]


def _not_stepped(prompts: PromptProcessingBatch, last: list[int]) -> GenerationBatch:
    """`prompts`' rows as decoding rows whose pending inputs are `last` (their
    prompts' last tokens), not run yet: mlx-lm's constructor runs a pass over
    rows it is given, and none over none, so they come in after it."""
    rows = GenerationBatch(
        prompts.model, [], mx.array(last, dtype=mx.int32), prompts.prompt_cache,
        prompts.tokens, [], prompts.fallback_sampler, [], prompts.stop_sequences,
        prompts.max_tokens,
    )  # fmt: skip
    rows.uids = prompts.uids
    rows.samplers = prompts.samplers
    rows.logits_processors = prompts.logits_processors
    rows._num_tokens = [0] * len(prompts.uids)
    rows._next_logprobs = [None] * len(prompts.uids)  # (no sample yet to have them)
    return rows
