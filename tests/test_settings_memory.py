"""Clients may send new settings with every request (stop sets, sampling values
from a slider, logit biases): the worker's memory stays flat however many."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

from helpers import generate, prompt, rss_mb

# More with SOAK_SETTINGS_REQUESTS (make soak runs 5000).
REQUESTS = int(os.environ.get("SOAK_SETTINGS_REQUESTS", "300"))
# Enough to fill every bounded cache of settings before the first reading.
WARM_UP = 300
ALLOWED_GROWTH_MB = 10


def distinct_settings(i: int) -> dict:
    """Settings no other request shares: every value drawn anew."""
    rng = random.Random(i)
    return {
        "temperature": 0.3 + rng.random(),
        "top_p": 0.5 + rng.random() / 2,
        "min_p": rng.random() / 10,
        # Past the warm-up, values it never drew: each new one could cost a compiled graph.
        "top_k": rng.randint(2, 99) if i < WARM_UP else rng.randint(100, 380),
        "repetition_penalty": 1 + rng.random(),
        "presence_penalty": rng.random(),
        "logit_bias": {rng.randrange(10, 380): rng.random() for _ in range(3)},
        "stop_token_ids": rng.sample(range(10, 380), 300),
        "seed": i,
    }


def test_memory_stays_flat_over_distinct_request_settings(spawn, model_dir):
    # No prefix cache: it keeps finished requests' KV caches by design.
    p = spawn("--model", str(model_dir), "--prompt-cache-bytes", "0")
    p.wait_serving()

    def run(indices: range) -> None:
        def one(i: int) -> None:
            settings = distinct_settings(i)
            r = generate(p.stub, prompt(6, i), max_tokens=2, **settings)
            assert r.complete.finish_reason in ("length", "stop")

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, indices))

    run(range(WARM_UP))
    before = rss_mb(p.proc.pid)
    run(range(WARM_UP, WARM_UP + REQUESTS))
    grown = rss_mb(p.proc.pid) - before
    print(f"\n{REQUESTS} requests of distinct settings: RSS {before:.0f} MB, {grown:+.1f} MB")
    assert grown < ALLOWED_GROWTH_MB * max(1, REQUESTS / 1000)
