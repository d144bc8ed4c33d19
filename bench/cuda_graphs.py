"""Whether a serving worker's CUDA graphs replay (`python -m bench.cuda_graphs`, CUDA only).

mlx records each run of kernels into a CUDA graph and keeps one executable
graph per node structure, updated in place while every kernel is the one
recorded; where a kernel differs the update fails and the graph is built
anew on the host, which can cost more than the pass. This starts our worker
with MLX_SAVE_CUDA_GRAPHS_DOT_FILE (every committed graph written out),
runs a closed loop of streams through it, and replays mlx's keeping of
graphs over the files of the timed part: how many commits met a new
structure, replayed, or were rebuilt because a kernel changed, and which
kernels changed. `--speculative` and `--kind` say what the worker runs
(`bench.speculation`'s workloads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import mlx.core as mx

from bench import workers
from bench.grpc_client import closed_loop
from bench.long_prompts import default_worker
from bench.model import SHAPES, ensure_model
from bench.speculation import DEFAULT_KINDS, temperature
from bench.workload import Workload

_NODE = re.compile(r'"graph_(\d+)_node_(\d+)"\[[^\]]*?label="(.*?)"\];', re.S)
_EDGE = re.compile(r'"graph_(\d+)_node_(\d+)" -> "graph_\d+_node_(\d+)";')


def _signature(text: str, kernels: bool) -> str:
    """A committed graph's nodes and edges, nested graphs inline: with
    `kernels`, each kernel by name, else only its kind (mlx's key)."""
    nodes: dict[str, dict[int, str]] = {}
    edges: dict[str, list[tuple[int, int]]] = {}
    for graph, node, label in _NODE.findall(text):
        lines = label.strip().split("\n")  # its number, then its kernel, child graph or kind
        nodes.setdefault(graph, {})[int(node)] = lines[1] if len(lines) > 1 else lines[0]
    for graph, a, b in _EDGE.findall(text):
        edges.setdefault(graph, []).append((int(a), int(b)))

    def graph(name: str) -> str:
        parts = []
        for _, what in sorted(nodes.get(name, {}).items()):
            if what.startswith("graph_"):
                parts.append("(" + graph(what.removeprefix("graph_")) + ")")
            elif what == "MEMSET":
                parts.append("M")
            else:
                parts.append(what if kernels else "K")
        return ",".join(parts) + "|" + ";".join(f"{a}-{b}" for a, b in sorted(edges.get(name, [])))

    return graph(next(iter(nodes))) if nodes else ""


def count(files: list[Path]) -> dict:
    """mlx's keeping of graphs replayed over committed graphs, in commit order."""
    kept: dict[str, str] = {}  # structure: the kernels last recorded for it
    counts = Counter(new=0, replayed=0, rebuilt=0)
    swaps: Counter = Counter()
    for path in files:
        text = path.read_text()
        structure, recorded = _signature(text, False), _signature(text, True)
        before = kept.get(structure)
        if before is None:
            counts["new"] += 1
        elif before == recorded:
            counts["replayed"] += 1
        else:
            counts["rebuilt"] += 1
            names = zip(re.split(r"[,|()]", before), re.split(r"[,|()]", recorded), strict=False)
            swaps.update(f"{a[:80]} -> {b[:80]}" for a, b in names if a != b)
        kept[structure] = recorded
    return {"commits": len(files), **counts, "structures": len(kept),
            "kernel_swaps": dict(swaps.most_common(8))}  # fmt: skip


def committed(folder: Path) -> list[Path]:
    """The graph files mlx wrote under `folder`, in the order it committed them."""
    return sorted(folder.glob("*.dot"), key=lambda p: int(p.stem.rpartition("_")[2]))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_graphs", description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--speculative", default="off", help="the worker's --speculative")
    parser.add_argument("--kind", choices=DEFAULT_KINDS, default="right")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8, help="timed requests")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--work-dir", type=Path, default=Path(".bench"))
    parser.add_argument("--out", type=Path, help="the figures as JSON")
    args = parser.parse_args()
    if not mx.cuda.is_available():
        parser.error("mlx's CUDA backend is not available here: CUDA graphs are CUDA's")
    model_dir = ensure_model(args.shape, args.work_dir / "models")
    folder = args.work_dir / "cuda-graphs"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = str(folder.resolve() / "graph")
    os.environ["MLX_USE_CUDA_GRAPHS"] = "1"  # (a speculating worker would turn them off)
    workload = Workload(gen_tokens=args.gen_tokens)
    hot = partial(temperature, args.kind)
    c = args.concurrency
    with default_worker(model_dir, args.work_dir, ["--speculative", args.speculative],
                        "cuda-graphs", 600) as (worker, _):  # fmt: skip
        asyncio.run(closed_loop(worker.address, workload, c, range(1000, 1000 + c), "w", hot))
        before = set(committed(folder))
        asyncio.run(closed_loop(worker.address, workload, c, range(args.requests), "t", hot))
        timed = [p for p in committed(folder) if p not in before]
    figures = {"shape": args.shape, "speculative": args.speculative, "kind": args.kind,
               "concurrency": c, **count(timed)}  # fmt: skip
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    sys.exit(0 if figures["commits"] else 1)  # none written: not CUDA, or graphs off


if __name__ == "__main__":
    workers.stop_on_sigterm()  # (the workers run in sessions of their own)
    main()
