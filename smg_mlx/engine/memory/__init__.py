"""What the model costs and what fits: the budget's arithmetic (`planner`,
pure), the start-up measurement of the model's memory and prefill time
(`probe`, MLX) and MLX's buffer cache kept through mlx-lm's passes
(`buffer_cache`, MLX).

May import the engine's `types` alone: everything else in the engine may
import it.
"""
