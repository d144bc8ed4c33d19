"""The scheduling policy, pure (no MLX): who starts and in which lane
(`scheduler`), who waits and what the prompt cache spares each
(`waiting_room`), what each pass prefills within the step budget (`step_plan`)
and how long a pass takes (`step_clock`), and bursts of arrivals gathered into
one admission (`bursts`).

May import `memory/` (the budget), the engine's `types` and `handoff`; never
MLX, the batch or the prefix cache (it sees the cache through the
`waiting_room.Prefixes` protocol, which the cache answers).
"""
