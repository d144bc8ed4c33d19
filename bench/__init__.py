"""`make bench`: the raw engine, this worker and the peer worker on one workload.

Modules, one job each:
- `workload`: request shape, prompts, how many requests per concurrency level;
- `model`: the random-weight models, built by `smg_mlx.demo_model.build_model`;
- `engine_raw`: drives mlx-lm's BatchGenerator directly, on one thread (child process);
- `grpc_client`: an asyncio MlxEngine client that keeps `concurrency` streams in flight;
- `agent`: sessions resending their whole history each turn, under three prefix-cache
  settings and across a restart (run after the throughput table, or alone with `--agent`);
  `--followups`: a context, then the same context extended;
- `workers`: starts a worker process, waits for SERVING, stops it; `free_port`;
- `peer`: the published peer worker's virtualenv and command line;
- `stats`: per-request records to per-level numbers;
- `report`: the table, the ratios and targets, the JSON file;
- `machine`: what the numbers were measured on;
- `runner` and `__main__`: the orchestration (systems take turns, level by level) and the
  command line.

BENCHMARKS.md at the repository top has the method, the commands and the results.
"""
