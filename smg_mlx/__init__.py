"""smg-mlx: an MLX inference worker for the SMG model gateway."""

__version__ = "0.1.0"
