"""Generated from proto/ by `make stubs` (proto/generate.py); do not edit."""
