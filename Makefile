# smg-mlx: `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The runtime dependencies (with the MLX backend) and the build backend, as
# wheels: tests/test_package.py builds and installs the package from them, offline.
WHEELHOUSE := $(VENV)/wheelhouse
WHEELS := $(WHEELHOUSE)/.complete

# Linux wheels of mlx need a backend extra (MLX_EXTRA=cuda13 for NVIDIA GPUs);
# macOS wheels carry Metal.
ifeq ($(shell uname -s),Darwin)
MLX_EXTRA ?=
else
MLX_EXTRA ?= cpu
endif
comma := ,
EXTRAS := test$(if $(MLX_EXTRA),$(comma)$(MLX_EXTRA))

HOST ?= 127.0.0.1
PORT ?= 50051
MODEL ?=
SERVE_ARGS ?=

.PHONY: install stubs serve test lint bench bench-gate soak clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@echo "installing smg-mlx and its dependencies into $(VENV) (pip is quiet while it downloads: a minute or more the first time)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

$(WHEELS): $(STAMP)
	$(PY) -m pip download -q -d $(WHEELHOUSE) ".$(if $(MLX_EXTRA),[$(MLX_EXTRA)])" "setuptools>=77"
	touch $@

# The gRPC stubs are committed; after changing proto/, regenerate and commit them
# (tests/test_stubs.py fails until they match).
stubs: $(STAMP)
	$(PY) proto/generate.py

serve: install
	$(VENV)/bin/smg-mlx serve $(if $(MODEL),--model $(MODEL),--demo) \
		--host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: install
	$(PY) -m ruff check smg_mlx tests bench proto

# Four processes on CI's two cores: most tests wait on workers (their start-up,
# their streams) more than they compute. Work stealing: a process left without
# tests takes some of another's, so a slow one at the end holds up less.
TEST_JOBS ?= 4

test: lint $(WHEELS)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal $(PYTEST_ARGS)

# Engine ceiling vs this worker vs the peer worker; BENCH_ARGS=--short for a quick run.
bench: install
	$(PY) -m bench $(BENCH_ARGS)

# The throughput gate (bench/gate.py): engine vs ours side by side, then the mixed
# run; exit status 1 when a ratio falls short. Meant for a GPU, e.g.
# make bench-gate MLX_EXTRA=cuda13 BENCH_ARGS="--shape qwen3-0.6b"
bench-gate: install
	$(PY) -m bench --gate $(BENCH_ARGS)

# Long soak (not part of `make test`): thousands of requests with random
# cancellations, then the exit-code and settings-memory tests at larger sizes.
soak: install
	$(PY) -m pytest -q -s -m slow tests/test_soak.py
	SOAK_EXIT_CYCLES=200 SOAK_SETTINGS_REQUESTS=5000 $(PY) -m pytest -q -s \
		tests/test_exit.py::test_start_stop_cycles_always_exit_zero \
		tests/test_settings_memory.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
