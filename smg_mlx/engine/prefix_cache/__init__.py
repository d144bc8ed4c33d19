"""The prompt cache: finished sequences' KV caches, kept for prompts that share
a prefix. `cache` is its one face to the batch and the scheduler; behind it a
memory tier (`memory_tier`) and a disk tier (`disk_tier`, with its folder,
file format and the model's fingerprint), both indexed by a radix tree of
token sequences (`token_tree`).

May import `schedule/` (the `waiting_room.Reuse` it answers the scheduler
with) and the engine's `types`; never the batch.
"""
