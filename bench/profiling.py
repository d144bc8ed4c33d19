"""py-spy around our worker's timed phases, and a per-thread summary of the samples.

py-spy attaches to the running worker (`--pid`) just before a level's timed
requests and detaches right after, so warm-up and start-up stay out of the
profile. `--nonblocking` keeps it from pausing the worker at each sample (less
distortion); `--idle` keeps samples of threads that wait, so the summary shows
how busy each thread is, not only what it does when busy.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
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
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip

    def stop(self) -> Path:
        self.process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        _, err = self.process.communicate(timeout=60)
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')}")
        return self.out


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
