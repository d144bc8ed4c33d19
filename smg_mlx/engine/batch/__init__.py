"""The batch and what runs it, on the engine thread: the model loaded (or this
rank's part of it), mlx-lm's BatchGenerators (a short and a long lane), the
start-up check of how the model may be batched, attention shapes, sampling and
the warm-up.

May import `schedule/`, `prefix_cache/`, `memory/` and the engine's `types`;
only `engine.core` imports it, and lazily (every module here but `warm_up`
imports MLX).
"""
