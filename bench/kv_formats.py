"""Quantized KV caches against the model's own (`python -m bench --kv-formats 16,8,4`).

For each KV format (16: the model's own; 8 and 4: `--kv-bits`), a fresh worker
with its default flags, `--worker-args` and that setting:

- **capacity**: distinct prompts of `--kv-fill-tokens`, one after another (one
  token out each), until the prefix cache's memory tier first drops an entry
  for room; the tokens it then holds (its bytes over one token's, both from
  the worker's metrics) are what one memory budget holds. Running rows take
  their room from the same budget, so this counts running and cached alike.
- **prefill**: `--kv-concurrency` requests of `--kv-context-tokens` distinct
  tokens at once, one token out: their prompt tokens over the time to the
  last first token.
- **decode**: as many streams over one context of `--kv-context-tokens`
  (cached by a request sent first), each with a short tail of its own and
  `--gen-tokens` out: the tokens they make a second from the first stream's
  first token to the last one's last. Each row holds the whole context, so
  the budget decides how many decode at once: what a format buys.

`--kv-parts` runs some of the three (a device's time is short). Each format's
figures are then put over the model's own; the quantized-KV
issue's targets: capacity at least 1.85x at 8 bits and 3.3x at 4, decode at
least 1.0x and prefill 0.8x at 8 bits.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.grpc_client import stream_one, token_request
from bench.long_prompts import default_worker, metrics
from bench.runner import progress
from bench.stats import RequestRecord
from bench.workers import WorkerExited
from bench.workload import Workload
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

MODEL_OWN = 16  # the format named for the model's own KV (no --kv-bits)
PARTS = ("capacity", "prefill", "decode")
HELD = 'smg_mlx_prefix_cache_tier_bytes{tier="memory"}'
DROPPED = 'smg_mlx_prefix_cache_evicted_total{tier="memory"}'
PER_TOKEN = "smg_mlx_memory_kv_bytes_per_token"
BUDGET = "smg_mlx_memory_budget_bytes"
SETTLE_S = 1.0  # for the worker's figures to take in the last request's entry
DECODE_TAIL_TOKENS = 16  # each decoding stream's own tokens after the shared context


@dataclass(frozen=True)
class KvFormats:
    formats: tuple[int, ...] = (MODEL_OWN, 8, 4)
    fill_tokens: int = 8192
    context_tokens: int = 32768
    concurrency: int = 16
    gen_tokens: int = 128
    parts: tuple[str, ...] = PARTS


def flags(bits: int) -> list[str]:
    """The worker's flags for a format."""
    return [] if bits == MODEL_OWN else ["--kv-bits", str(bits)]


async def _together(address: str, prompts: list[list[int]], gen: int,
                    tag: str) -> list[RequestRecord]:  # fmt: skip
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
        return await asyncio.gather(*(
            stream_one(stub, token_request(ids, gen, f"{tag}-{i}"), gen)
            for i, ids in enumerate(prompts)
        ))  # fmt: skip


def capacity(address: str, port: int, fill: Workload) -> dict:
    """Fill the memory tier (see the module's doc): the tokens it holds."""
    budget, per_token = metrics(port, BUDGET, PER_TOKEN)
    if not budget or not per_token:
        raise RuntimeError("the worker's metrics give no memory budget or KV bytes per token")
    # Enough prompts to fill the whole budget, and then some: one that never
    # fills is reported as such.
    most = int(1.5 * budget / (per_token * fill.prompt_tokens)) + 2
    progress(f"capacity: up to {most} prompts of {fill.prompt_tokens} tokens, until the "
             f"memory tier drops one (a {budget / 2**30:.1f} GiB budget; --worker-args "
             "'--memory-budget SIZE' for a smaller one)")  # fmt: skip
    sent, dropped = 0, 0.0
    while sent < most and not dropped:
        (record,) = asyncio.run(_together(address, [fill.prompt(sent)], 1, f"fill-{sent}"))
        if record.error:
            raise RuntimeError(f"a capacity prompt failed: {record.error}")
        sent += 1
        if sent % 10 == 0:
            progress(f"capacity: {sent} of up to {most} prompts sent")
        (dropped,) = metrics(port, DROPPED)
    time.sleep(SETTLE_S)
    (held,) = metrics(port, HELD)
    return {
        "prompts": sent, "filled": bool(dropped), "kv_bytes_per_token": per_token,
        "budget_bytes": budget, "tokens_held": (held or 0) / per_token,
    }  # fmt: skip


def prefill(address: str, run: KvFormats, tag: str) -> dict:
    """`run.concurrency` distinct long prompts sent at once: their tokens over
    the time to the last first token."""
    context = Workload(prompt_tokens=run.context_tokens, gen_tokens=1, seed=7)
    prompts = [context.prompt(i) for i in range(run.concurrency)]
    records = asyncio.run(_together(address, prompts, 1, f"{tag}-prefill"))
    failed = [r.error for r in records if r.error]
    if failed:
        return {"errors": len(failed), "first_error": failed[0]}
    all_started = max(r.ttft for r in records)
    return {
        "errors": 0, "prefill_tok_s": run.concurrency * run.context_tokens / all_started,
        "last_first_token_s": all_started,
    }  # fmt: skip


def decode(address: str, run: KvFormats, tag: str) -> dict:
    """`run.concurrency` streams over one long context, cached by a request
    sent first, each with a short tail of its own: they decode together (as
    many as the budget holds at once), each row holding the whole context.
    What they make a second, from the first one's first token to the last
    one's last."""
    context = Workload(prompt_tokens=run.context_tokens, seed=8).prompt(0)
    tails = Workload(prompt_tokens=DECODE_TAIL_TOKENS, seed=9)
    (first,) = asyncio.run(_together(address, [context], 1, f"{tag}-context"))
    prompts = [context + tails.prompt(i) for i in range(run.concurrency)]
    records = asyncio.run(_together(address, prompts, run.gen_tokens, f"{tag}-decode"))
    failed = [r.error for r in [first, *records] if r.error]
    if failed:
        return {"errors": len(failed), "first_error": failed[0]}
    span = max(r.last for r in records) - min(r.ttft for r in records)
    made = sum(r.tokens - 1 for r in records)
    gaps = [gap for r in records for gap in r.itl]
    return {
        "decode_tok_s": made / span if span > 0 else None, "decode_span_s": span,
        "decode_step_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "decode_cached_tokens": min(r.cached_tokens for r in records),
    }  # fmt: skip


def run_kv_formats(model_dir: Path, work_dir: Path, run: KvFormats, extra: list[str],
                   timeout_s: float) -> dict:  # fmt: skip
    """Each format's capacity and speed, and each over the model's own."""
    fill = Workload(prompt_tokens=run.fill_tokens, gen_tokens=1)
    results = {}
    for bits in run.formats:
        tag = f"kv{bits}"
        try:
            results[bits] = _measure(model_dir, work_dir, run, [*extra, *flags(bits)], tag,
                                     fill, timeout_s)  # fmt: skip
        except WorkerExited as exc:
            if bits == MODEL_OWN or exc.code != 2:
                raise
            # A format the model cannot take: the others are still measured.
            results[bits] = {"skipped": exc.reason()}
        progress(f"{tag}: {format_row(bits, results[bits], results.get(MODEL_OWN))}")
    return {"run": asdict(run), "formats": {str(b): r for b, r in results.items()}}


def _measure(model_dir: Path, work_dir: Path, run: KvFormats, flags: list[str], tag: str,
             fill: Workload, timeout_s: float) -> dict:  # fmt: skip
    """One format's figures, from a worker of its own."""
    with default_worker(model_dir, work_dir, flags, tag, timeout_s) as (worker, port):
        figures: dict = {}
        if "capacity" in run.parts:
            progress(f"{tag}: capacity")
            figures |= capacity(worker.address, port, fill)
            progress(f"{tag}: holds {figures['tokens_held']:.0f} tokens, "
                     f"{figures['kv_bytes_per_token']:.0f} B a token")  # fmt: skip
        for part, measure in (("prefill", prefill), ("decode", decode)):
            if part in run.parts and not figures.get("errors"):
                progress(f"{tag}: {part}, {run.concurrency} x {run.context_tokens} tokens")
                figures |= measure(worker.address, run, tag)
        return figures


def ratios(result: dict, own: dict | None) -> dict[str, float | None]:
    """A format's figures over the model's own."""
    def over(key: str) -> float | None:
        if own is None or not own.get(key) or result.get(key) is None:
            return None
        return result[key] / own[key]

    return {key: over(key) for key in ("tokens_held", "prefill_tok_s", "decode_tok_s")}


def format_row(bits: int, result: dict, own: dict | None) -> str:
    name = "model's own" if bits == MODEL_OWN else f"{bits} bits"
    if "skipped" in result:
        return f"{name}: skipped, the worker refused it: {result['skipped']}"
    if result.get("errors"):
        return f"{name}: {result['errors']} requests failed: {result['first_error']}"
    rel = ratios(result, own) if bits != MODEL_OWN else {}

    def x(key: str) -> str:
        return f" (x{rel[key]:.2f})" if rel.get(key) is not None else ""

    said = []
    if "tokens_held" in result:
        filled = "" if result["filled"] else " (never filled: more prompts needed)"
        said.append(f"holds {result['tokens_held']:.0f} tokens{x('tokens_held')}{filled}, "
                    f"{result['kv_bytes_per_token']:.0f} B a token")  # fmt: skip
    if "prefill_tok_s" in result:
        said.append(f"prefill {result['prefill_tok_s']:.0f} tok/s{x('prefill_tok_s')}")
    if "decode_tok_s" in result:
        said.append(f"decode {result['decode_tok_s'] or 0:.0f} tok/s{x('decode_tok_s')}")
    return f"{name}: {'; '.join(said)}"


def format_kv_formats(result: dict) -> str:
    formats = {int(b): r for b, r in result["formats"].items()}
    own = formats.get(MODEL_OWN)
    return "\n".join(format_row(b, r, own) for b, r in formats.items())

