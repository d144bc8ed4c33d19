"""What every system is asked to do: the same prompts, lengths and batch limits."""

from __future__ import annotations

import argparse
import random
from dataclasses import asdict, dataclass

# Prompt ids are drawn from this range: below every byte-level tokenizer's size
# and above its special tokens (pad, bos, eos, chat markers), for any model.
PROMPT_ID_RANGE = (10, 250)


@dataclass(frozen=True)
class Level:
    """One round of one concurrency level: its warm-up and timed requests."""

    concurrency: int
    round: int  # 0, 1, ...: each system runs every round of a level before the next level
    warmup: range  # prompt indices of the untimed requests
    timed: range  # prompt indices of the timed requests


@dataclass(frozen=True)
class Workload:
    """What each system is asked to do, and how many times per concurrency level."""

    prompt_tokens: int = 64
    gen_tokens: int = 64
    # Answers of gen_tokens +- gen_spread tokens, drawn per prompt: requests
    # that start together end apart, as real answers do.
    gen_spread: int = 0
    # Timed requests per level: max(min_requests, requests_per_slot * concurrency),
    # so high concurrency levels run long enough to reach a steady state.
    min_requests: int = 64
    requests_per_slot: int = 4
    # Untimed requests run first at each level (at least one per slot) so every
    # batch shape the level reaches is compiled and allocated before timing.
    warmup_per_slot: int = 1
    min_warmup: int = 4
    # Both servers and the raw engine get the same BatchGenerator limits, but
    # the prefill chunk: ours picks its own for the backend.
    completion_batch_size: int = 64
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    seed: int = 0

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_slot * concurrency)

    def warmup(self, concurrency: int) -> int:
        return max(self.min_warmup, self.warmup_per_slot * concurrency)

    def prompt(self, index: int) -> list[int]:
        """Prompt number `index`: distinct per request, so no prefix cache can help."""
        rng = random.Random(self.seed * 1_000_003 + index)
        low, high = PROMPT_ID_RANGE
        return [rng.randrange(low, high) for _ in range(self.prompt_tokens)]

    def answer_tokens(self, index: int) -> int:
        """How many tokens request number `index` asks for (the same in every system)."""
        if not self.gen_spread:
            return self.gen_tokens
        rng = random.Random(self.seed * 1_000_003 + index + 1)
        return max(1, self.gen_tokens + rng.randint(-self.gen_spread, self.gen_spread))

    def plan(self, levels: list[int], rounds: int = 1) -> list[Level]:
        """Each level's rounds, level by level, numbered so that every request of a
        run gets its own prompt (nothing for a prefix cache to reuse), the same
        one in every system."""
        plan, first = [], 0
        for c in levels:
            warm, timed = self.warmup(c), self.requests(c)
            for r in range(rounds):
                warmup = range(first, first + warm)
                plan.append(Level(c, r, warmup, range(warmup.stop, warmup.stop + timed)))
                first = warmup.stop + timed
        return plan

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        return cls(**data)


SHORT = {"min_requests": 16, "requests_per_slot": 2}


def parse_levels(text: str) -> list[int]:
    """Parses "1,4,16,64" into [1, 4, 16, 64]."""
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be positive integers, got {text!r}")
    return levels


def levels_flag(text: str) -> str:
    """An argparse type: `text` as given, where `parse_levels` takes it."""
    try:
        parse_levels(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected positive integers, comma-separated (e.g. 1,4,16), got {text!r}"
        ) from None
    return text

