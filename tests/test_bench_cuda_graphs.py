"""bench.cuda_graphs replays mlx's keeping of CUDA graphs over the files a
worker's graphs were written to (the format of cudaGraphDebugDotPrint)."""

from __future__ import annotations

from pathlib import Path

from bench.cuda_graphs import committed, count


def dot(graph: int, kernels: list[str], child: str | None = None) -> str:
    """A committed graph of `kernels` in a row, and a child graph of one kernel."""
    nodes = [f'"graph_{graph}_node_{i}"[style="bold" shape="octagon" label="{i}\n{name}\n"];'
             for i, name in enumerate(kernels)]  # fmt: skip
    edges = [f'"graph_{graph}_node_{i}" -> "graph_{graph}_node_{i + 1}";'
             for i in range(len(kernels) - 1)]  # fmt: skip
    text = f'digraph dot {{\nsubgraph cluster_{graph} {{\nlabel="graph_{graph}";\n'
    if child is not None:
        n = len(kernels)
        nodes.append(f'"graph_{graph}_node_{n}"[style="solid" label="{n}\ngraph_{graph + 1}\n"];')
        text += "\n".join(nodes + edges) + "\n}\n"
        text += f'subgraph cluster_{graph + 1} {{\nlabel="graph_{graph + 1}";\n'
        text += f'"graph_{graph + 1}_node_0"[style="bold" label="0\n{child}\n"];\n}}\n}}\n'
        return text
    return text + "\n".join(nodes + edges) + "\n}\n}\n"


def test_commits_are_new_replayed_or_rebuilt_where_a_kernel_changed(tmp_path: Path):
    graphs = [
        dot(10, ["copy", "gemv"], child="sdpa_a"),  # new
        dot(20, ["copy", "gemv"], child="sdpa_a"),  # the same kernels: replayed
        dot(30, ["copy", "gemm"], child="sdpa_a"),  # same structure, a kernel changed
        dot(40, ["copy", "gemm"], child="sdpa_b"),  # and one in the child graph
        dot(50, ["copy", "gemm", "add"]),  # another structure
        dot(60, ["copy", "gemm"], child="sdpa_b"),  # as last recorded: replayed
    ]
    # Written as mlx names them, a count after the prefix, not in name order.
    for number, text in enumerate(graphs, start=8):
        (tmp_path / f"graph_{number}.dot").write_text(text)
    files = committed(tmp_path)
    assert [f.name for f in files][:3] == ["graph_8.dot", "graph_9.dot", "graph_10.dot"]
    figures = count(files)
    assert (figures["commits"], figures["new"], figures["replayed"], figures["rebuilt"]) == (
        6, 2, 2, 2)  # fmt: skip
    assert figures["structures"] == 2
    assert figures["kernel_swaps"] == {"gemv -> gemm": 1, "sdpa_a -> sdpa_b": 1}
