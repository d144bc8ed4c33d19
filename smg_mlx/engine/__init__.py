"""The engine: one thread that owns MLX and runs mlx-lm's BatchGenerator.

`types` (the values handed in and out) and `handoff` (the thread boundary)
are all a front door needs; `core` is the loop. Only `batch`, `prefix_cache`,
`sampling`, `memory_probe`, `lockstep` and `placement` import MLX, and only the
engine thread runs them, but for `placement`: a rank of a distributed launch
runs it on its main thread before anything else (see there).
"""
