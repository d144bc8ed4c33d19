"""The engine: one thread that owns MLX and runs mlx-lm's BatchGenerator.

At the top, `types` (the values handed in and out) and `handoff` (the thread
boundary) are all a front door needs; `core` is the loop, and `start_up` makes
and checks its parts. Below them, one sub-package per concern, each importing
only those under it:

- `batch/`: the model and the BatchGenerators that run it (engine thread);
- `prefix_cache/`: finished sequences' KV caches kept for prompts that share a prefix;
- `schedule/`: who runs each step and how much it prefills (pure, no MLX);
- `ranks/`: several processes serving one model;
- `memory/`: what the model costs and what fits the budget.

Only the engine thread imports MLX, but for `ranks.placement`: a rank of a
distributed launch runs it on its main thread before anything else (see there).
"""
