"""Several ranks serving one model: which rank this process is (`launched`,
read before MLX loads), its device and group (`placement`), and rank 0's
decisions shared over `mx.distributed` with a watchdog (`lockstep`).

Imports nothing else of the engine but `handoff` (the turn times its watchdog reads).
"""
