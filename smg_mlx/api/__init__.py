"""The gRPC front door, on the event loop: handlers, validation, streaming. No MLX."""
