"""smg-mlx: an MLX inference worker for the SMG model gateway."""

import sys

__version__ = "0.1.0"

# The worker never runs PyTorch, but transformers (mlx-lm's tokenizers) imports
# it, and what it brings, wherever it is installed: seconds of every start, and
# on CUDA its own libnccl, which ranks cannot mix with MLX's. Every process of
# ours imports this package before transformers, which then finds it absent.
sys.modules.setdefault("torch", None)
