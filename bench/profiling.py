"""py-spy around our worker's timed phases, and a per-thread summary of the samples.

py-spy attaches to the running worker (`--pid`) just before a level's timed
requests and detaches right after, so warm-up and start-up stay out of the
profile. `--nonblocking` keeps it from pausing the worker at each sample (less
distortion); `--idle` keeps samples of threads that wait, so the summary shows
how busy each thread is, not only what it does when busy.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# Leaf frames that mean "this thread is waiting", not working.
IDLE_MARKERS = ("select (selectors.py", "wait (threading.py", "_worker (concurrent")


def find_py_spy() -> str:
    path = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(path).exists():
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    return path


class PySpy:
    """One py-spy recording of `pid`, written to `out` (collapsed stacks)."""

    def __init__(self, pid: int, out: Path, rate: int = 250) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.process = subprocess.Popen(
            [
                find_py_spy(), "record", "--pid", str(pid), "--threads", "--idle",
                "--nonblocking", "--rate", str(rate), "--format", "raw", "--output", str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        # Start timing only once py-spy samples: the worker idles until then, and
        # idle samples before the timed requests would read as engine idle time.
        self._said = []
        for line in self.process.stdout:
            self._said.append(line)
            if b"Sampling process" in line:
                break

    def stop(self) -> Path:
        self.process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        out, _ = self.process.communicate(timeout=60)
        if not self.out.exists():
            said = b"".join(self._said) + (out or b"")
            raise RuntimeError(f"py-spy wrote nothing: {said.decode(errors='replace')}")
        return self.out


class ThreadCpu:
    """CPU seconds per thread of a process over a window, from /proc (Linux).

    py-spy sees Python frames only; this also counts native threads (MLX's
    CPU stream, gRPC's pollers), which compete for the same cores.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.started = time.monotonic()
        self.before = self._read()

    def _read(self) -> dict[int, float]:
        seconds = {}
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:  # the thread ended
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "(comm) "
            seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / self.ticks
        return seconds

    def snapshot(self) -> tuple[float, dict[int, float]]:
        """The window's end: (wall seconds since the start, CPU seconds per thread)."""
        return time.monotonic() - self.started, self._read()

    def report(self, end: tuple[float, dict[int, float]], names: dict[int, str]) -> str:
        """`names`: thread id -> Python thread name (from py-spy); others are native."""
        wall, after = end
        used = {tid: after[tid] - self.before.get(tid, 0.0) for tid in after}
        lines = [f"== CPU per thread over {wall:.1f}s wall (100% = one core busy)"]
        for tid, seconds in sorted(used.items(), key=lambda kv: -kv[1]):
            if seconds > 0:
                name = names.get(tid, "native (MLX or gRPC)")
                lines.append(f"    {100 * seconds / wall:6.1f}%  {tid} {name}")
        lines.append(f"    {100 * sum(used.values()) / wall:6.1f}%  whole process")
        return "\n".join(lines)


def thread_names(raw: Path) -> dict[int, str]:
    """Thread ids and names from py-spy's first frames: 'thread (27877): mlx-engine'."""
    names = {}
    for line in raw.read_text().splitlines():
        match = re.match(r"thread \((\d+)\): ([^;]*)", line)
        if match:
            names[int(match.group(1))] = match.group(2)
    return names


def _frame_name(frame: str) -> str:
    """'step (smg_mlx/engine_loop.py:97)' -> 'step (engine_loop.py)': lines merged."""
    name, _, where = frame.partition(" (")
    file = where.split(":")[0].rsplit("/", 1)[-1].rstrip(")")
    return f"{name} ({file})" if file else name


def summarize(raw: Path, top: int = 12) -> str:
    """Per thread: share of samples, top self frames and top inclusive frames."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        # With --threads, the first frame names the thread.
        thread, frames = frames[0], [_frame_name(f) for f in frames[1:]]
        if frames and frames[0].startswith("process "):
            frames = frames[1:]
        totals[thread] += count
        if frames:
            threads[thread][frames[-1]] += count
            for name in set(frames):
                inclusive[thread][name] += count
    lines = []
    for thread, total in totals.most_common():
        lines.append(f"== {thread}: {total} samples")
        lines.append("  self:")
        for name, n in threads[thread].most_common(top):
            lines.append(f"    {100 * n / total:5.1f}%  {name}")
        lines.append("  inclusive:")
        for name, n in inclusive[thread].most_common(top):
            lines.append(f"    {100 * n / total:5.1f}%  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1])))
