"""`python -m bench --host-bound-ms N`: every decoding step of the processes the
bench starts spends N ms in Python first, as a host-bound GPU step does."""

import json
import os
import subprocess
import sys

import bench.__main__ as bench_main

# A decoding loop on the tiny model: the median time of its steps, in ms.
LOOP = """
import json, statistics, sys, time
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
model, _ = load(sys.argv[1])
generator = BatchGenerator(model)
generator.insert([[11, 12, 13, 14]], max_tokens=[12])
times = []
for _ in range(10):
    started = time.perf_counter()
    generator.next()
    times.append(1000 * (time.perf_counter() - started))
print(json.dumps(statistics.median(times[4:])))
"""


def step_ms(model_dir, env) -> float:
    done = subprocess.run(
        [sys.executable, "-c", LOOP, str(model_dir)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_processes_the_bench_starts_hold_each_decoding_step(model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv("BENCH_HOST_BOUND_MS", raising=False)
    bench_main.host_bound(80)
    assert step_ms(model_dir, dict(os.environ)) >= 80  # the tiny model's own: a few ms
