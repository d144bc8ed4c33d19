"""What the model costs and what fits: the costs themselves, in bytes and in
prefill seconds (`costs`, plain values), the budget's arithmetic (`planner`,
pure), their start-up measurement (`probe`, MLX) and MLX's buffer cache kept
through mlx-lm's passes (`buffer_cache`, MLX).

May import the engine's `types` alone: everything else in the engine may
import it.
"""
