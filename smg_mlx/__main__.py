"""`python -m smg_mlx` and the `smg-mlx` command. Stop signals are taken
before the rest is imported (about a tenth of a second): one that comes then
ends the process with 0, as at any later time, not with Python's 143 or a
KeyboardInterrupt traceback."""

from smg_mlx.stop_signals import stop_quietly


def run() -> int:
    stop_quietly()
    from smg_mlx.cli import main

    return main()


if __name__ == "__main__":
    raise SystemExit(run())
