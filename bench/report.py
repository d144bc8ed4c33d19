"""The results table, the ratios ours/engine and ours/peer, the targets, the JSON."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from bench.stats import LevelResult

# (ratio name, concurrency levels it applies at, the bound, "min" or "max").
TARGETS = [
    ("ours/engine tok/s", (16, 64), 0.9, "min"),
    ("ours/peer tok/s", (4, 16, 64), 1.5, "min"),
    ("ours/peer TTFT p99", (64,), 0.5, "max"),
]


def _by(results: list[LevelResult]) -> dict[tuple[str, int], LevelResult]:
    return {(r.system, r.concurrency): r for r in results}


def _div(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def ratios(results: list[LevelResult]) -> list[dict]:
    """Per concurrency level, each ratio both of whose systems ran."""
    table = _by(results)
    out = []
    for c in sorted({r.concurrency for r in results}):
        ours, engine, peer, two = (table.get((s, c)) for s in ("ours", "engine", "peer", "2ranks"))
        row: dict = {"concurrency": c}
        if ours and two:
            row["2ranks/ours tok/s"] = _div(two.tok_s, ours.tok_s)
        if ours and engine:
            row["ours/engine tok/s"] = _div(ours.tok_s, engine.tok_s)
        if ours and peer:
            row["ours/peer tok/s"] = _div(ours.tok_s, peer.tok_s)
            row["ours/peer TTFT p99"] = _div(ours.ttft_p99_ms, peer.ttft_p99_ms)
        out.append(row)
    return out


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets that this run can judge (both systems and the level ran)."""
    checked = []
    for name, levels, bound, kind in TARGETS:
        for row in rows:
            if row["concurrency"] in levels and name in row:
                value = row[name]
                ok = value >= bound if kind == "min" else value <= bound
                checked.append(
                    {"ratio": name, "concurrency": row["concurrency"], "value": value,
                     "target": f"{'>=' if kind == 'min' else '<='} {bound}", "met": ok}
                )  # fmt: skip
    return checked


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def format_table(results: list[LevelResult]) -> str:
    header = (
        f"{'system':<7} {'conc':>4} {'reqs':>5} {'err':>3} {'gen tok/s':>9} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/chunk':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in sorted(results, key=lambda r: (r.concurrency, r.system)):
        lines.append(
            f"{r.system:<7} {r.concurrency:>4} {r.requests:>5} {r.errors:>3} {r.tok_s:>9.0f} "
            f"{_fmt(r.ttft_p50_ms):>9} {_fmt(r.ttft_p99_ms):>9} {_fmt(r.itl_p50_ms, 2):>8} "
            f"{_fmt(r.itl_p99_ms, 2):>8} {_fmt(r.tokens_per_chunk, 2):>9}"
        )
    lines.append("(times in ms; ITL per token gap, a chunk of k tokens counts k gaps of 1/k)")
    return "\n".join(lines)


def format_ratios(rows: list[dict], checked: list[dict]) -> str:
    names = [
        n for n in (*(t[0] for t in TARGETS), "2ranks/ours tok/s") if any(n in row for row in rows)
    ]
    if not names:
        return ""
    lines = [f"{'conc':>4}  " + "  ".join(f"{n:>18}" for n in names)]
    for row in rows:
        cells = "  ".join(f"{_fmt(row.get(n, float('nan')), 2):>18}" for n in names)
        lines.append(f"{row['concurrency']:>4}  {cells}")
    for t in checked:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(
            f"target {t['ratio']} at {t['concurrency']}: {t['value']:.2f} ({t['target']}) {verdict}"
        )
    return "\n".join(lines)


def default_out(machine_slug: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path("bench-results") / f"{machine_slug}-{stamp}.json"


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # NaN is not JSON: a level with no samples reads as null.
    clean = json.loads(json.dumps(payload), parse_constant=lambda _: None)
    path.write_text(json.dumps(clean, indent=2) + "\n")
    return path
