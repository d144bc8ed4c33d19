"""`make bench`: the raw engine, this worker and the peer worker on one workload.

Modules, one job each:
- `workload`: request shape, prompts, how many requests per concurrency level;
- `model`: builds the random-weight model (in a child process, via `smg_mlx.demo_model`);
- `engine_raw`: drives mlx-lm's BatchGenerator directly, on one thread (child process);
- `grpc_client`: an asyncio MlxEngine client that keeps `concurrency` streams in flight;
- `multiturn`: conversations resending their history, our worker with and without its
  prefix cache (run after the throughput table);
- `workers`: starts a worker process, waits for SERVING, stops it;
- `peer`: the published peer worker's virtualenv and command line;
- `profiling`: py-spy around our worker's timed phases, CPU per thread, a summary;
- `stats`: per-request records to per-level numbers;
- `report`: the table, the ratios and targets, the JSON file;
- `machine`: what the numbers were measured on;
- `runner` and `__main__`: the orchestration (systems take turns, level by level) and the
  command line;
- `stage_gpu.sh`: packs the bench for the offline GPU machine.

BENCHMARKS.md at the repository top has the commands, results and profiles.
"""
