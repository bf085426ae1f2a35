# fastckpt: the one entry point for people, hooks and CI.
#   make setup   venv + Python deps (reused when present) + release build of the extension
#   make demo    setup, then run the demo on a small embedded example
#   make wheel   the release wheels under dist/: one cp311-abi3 manylinux2014 wheel per
#                architecture (x86_64, aarch64; built with zig from PyPI) and the sdist
#   make test    setup + wheel, then cargo tests (also for aarch64 under qemu-user), lints,
#                pytest (tests/test_wheel.py installs the wheel in clean CPython 3.11, 3.12 and
#                3.13 venvs without Rust), and the focused suite on the lowest torch and numpy
#   make test-lowest  the focused suite in .venv-min: pyproject.toml's lower bounds, pinned
#   make lint    cargo fmt --check, clippy -D warnings, ruff check/format, mypy
#   make bench   setup, then the benchmark harness (see BENCH_ARGS)
#   make bench-s3  setup, the Rust S3 server (built once), then the object-storage scenario
#   make bench-s3-sharded  setup, then sharded checkpoints (2 ranks) on a local moto server

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Python deps come from pyproject.toml (runtime + every extra): one list, not two.
DEPS = $$($(PY) tools/deps.py all)
# Downloaded wheels are kept here between runs and venvs (the package index this machine
# reaches sends no caching headers, so pip's own HTTP cache stays empty): torch and its CUDA
# libraries are downloaded once per version, not once per venv or per CI run.
WHEELHOUSE ?= $(HOME)/.cache/fastckpt-wheelhouse
export FASTCKPT_WHEELHOUSE := $(abspath $(WHEELHOUSE))
RUST_SOURCES := Cargo.toml Cargo.lock pyproject.toml $(wildcard rust/*.rs)
PY_SOURCES := $(shell find python -name '*.py' -o -name '*.pyi' -o -name 'py.typed')
WHEEL_TAG := manylinux2014
HOST_ARCH := $(shell uname -m)
# The wheels `make wheel` builds: the host's, and aarch64's cross-compiled (linked by zig).
CROSS_TARGET := aarch64-unknown-linux-gnu
# The lowest-bound venv: the oldest claimed Python with pyproject.toml's lower bounds pinned,
# and the focused suite it runs (files, checkpoints, manager, strategy, DCP/FSDP2, staging).
PYTHON_LOWEST ?= python3.11
VENV_LOWEST ?= .venv-min
PY_LOWEST := $(VENV_LOWEST)/bin/python
LOWEST_TESTS := tests/test_files.py tests/test_checkpoint.py tests/test_manager.py \
	tests/test_strategy.py tests/test_staging.py tests/test_dcp.py tests/test_sharded_strategy.py
BENCH_ARGS ?= --size-gib 1.5 --repeats 3 --drop-caches --out benches/results

.PHONY: setup demo wheel test lint bench cargo-test cargo-test-aarch64 aarch64-tools pytest \
	test-lowest clean s3-server bench-s3 bench-s3-sharded bench-tiers

setup: $(VENV)/.fastckpt-built

# CPython 3.11 or newer is supported (pyproject.toml's requires-python): check the venv's
# interpreter before installing anything into it.
$(VENV)/.python-checked:
	@test -x $(PY) || { echo "==> creating $(VENV) with $$($(PYTHON) --version)"; $(PYTHON) -m venv $(VENV); }
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else "fastckpt needs CPython 3.11 or newer, $(VENV) has " + sys.version.split()[0] + ": remove $(VENV) and run make PYTHON=python3.11 ...")'
	@touch $@

# Reuses an existing venv and pip's cache; works from nothing on a fresh machine.
$(VENV)/.deps-installed: pyproject.toml tools/constraints.txt $(VENV)/.python-checked
	@echo "==> upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "==> installing the Python dependencies (the first run downloads torch, a few GB, into $(WHEELHOUSE))"
	@mkdir -p $(WHEELHOUSE)
	@eval $(PY) -m pip download --quiet --dest $(WHEELHOUSE) -c tools/constraints.txt $(DEPS)
	@eval $(PY) -m pip install --quiet --no-compile --find-links $(WHEELHOUSE) -c tools/constraints.txt $(DEPS)
	@touch $@

# The distribution was called `fastckpt` before it became `fastckpt-io`: an old development
# install of that name is removed first so that two records never own the same files.
$(VENV)/.fastckpt-built: $(VENV)/.deps-installed $(RUST_SOURCES)
	@echo "==> building the Rust extension (release) into $(VENV)"
	@$(PY) -m pip uninstall --yes --quiet fastckpt 2>/dev/null || true
	@PIP_QUIET=1 $(VENV)/bin/maturin develop --release --quiet
	@touch $@

# The wheels and the sdist, built once and reused by tests/test_wheel.py (FASTCKPT_DIST). The
# extension uses CPython's stable ABI (abi3, 3.11+), so one wheel per architecture serves
# every supported Python; the aarch64 one is cross-compiled here, zig linking it against
# glibc 2.17. `rustup target add` is a no-op once the target's standard library is installed.
dist/.wheel-built: $(VENV)/.deps-installed $(RUST_SOURCES) $(PY_SOURCES) README.md LICENSE
	@echo "==> building the release wheels ($(HOST_ARCH), $(CROSS_TARGET)) for $(WHEEL_TAG) with zig, and the sdist"
	rm -f dist/*.whl dist/*.tar.gz
	@rustup --quiet target add $(CROSS_TARGET)
	$(VENV)/bin/maturin build --release --zig --compatibility $(WHEEL_TAG) -i $(PY) --out dist --quiet
	$(VENV)/bin/maturin build --release --zig --compatibility $(WHEEL_TAG) -i $(PY) --target $(CROSS_TARGET) --out dist --quiet
	$(VENV)/bin/maturin sdist --out dist
	touch $@

wheel: dist/.wheel-built

demo: setup
	@echo "==> running the demo"
	$(PY) -m fastckpt.demo

cargo-test:
	cargo test --quiet

# The Rust core's tests built for aarch64 and run under qemu-user (Debian's qemu-user, with
# the aarch64 cross linker and C library as the sysroot qemu loads the test binaries with).
AARCH64_ENV := CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo-test-aarch64: aarch64-tools
	@rustup --quiet target add $(CROSS_TARGET)
	$(AARCH64_ENV) cargo test --quiet --target $(CROSS_TARGET)

aarch64-tools:
	@command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null \
		&& test -e /usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1 || { \
		echo "==> installing qemu-user and the aarch64 cross toolchain (Debian packages; needs root)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null; }

lint: setup
	cargo fmt --check
	cargo clippy --quiet --all-targets --features python -- -D warnings
	$(VENV)/bin/ruff check python tests tools $(wildcard benches/*.py)
	$(VENV)/bin/ruff format --check python tests tools $(wildcard benches/*.py)
	$(VENV)/bin/mypy

# A test still running after PYTEST_TIMEOUT seconds fails with its threads' stacks (a hang is
# a failure that names itself, not a CI run cut off at its time limit).
PYTEST_TIMEOUT ?= 600
# Tests run in PYTEST_WORKERS processes (pytest-xdist), a test file's tests all in one of them
# (--dist loadfile: a module's fixtures are built once, its tests keep their order). Most
# tests wait on subprocesses, fsync and a local S3 server rather than compute: two workers
# on CI's two cores take the suite from ~80 to ~36 minutes. PYTEST_WORKERS=0 runs it serially.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)
pytest: setup wheel
	FASTCKPT_DIST=dist $(PY) -m pytest -q --durations=20 --timeout=$(PYTEST_TIMEOUT) $(PYTEST_PARALLEL) tests

# The lowest claimed torch and numpy (pyproject.toml's lower bounds, pinned by tools/deps.py)
# on the oldest claimed Python, with the host's wheel installed: a second venv, .venv-min,
# ignored by git (its own .gitignore) and filled from the wheelhouse.
$(VENV_LOWEST)/.deps-installed: pyproject.toml tools/deps.py $(VENV)/.deps-installed
	@test -x $(PY_LOWEST) || { echo "==> creating $(VENV_LOWEST) with $$($(PYTHON_LOWEST) --version)"; $(PYTHON_LOWEST) -m venv $(VENV_LOWEST); }
	@printf '*\n' > $(VENV_LOWEST)/.gitignore
	@$(PY_LOWEST) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "$(VENV_LOWEST) must be CPython 3.11, the oldest claimed; it has " + sys.version.split()[0])'
	@echo "==> installing the lowest claimed dependencies into $(VENV_LOWEST): $$($(PY) tools/deps.py lowest)"
	mkdir -p $(WHEELHOUSE)
	@eval $(PY) -m pip download --quiet --only-binary :all: --python-version 3.11 --dest $(WHEELHOUSE) $$($(PY) tools/deps.py lowest)
	@eval $(PY_LOWEST) -m pip install --quiet --no-compile --no-index --find-links $(WHEELHOUSE) $$($(PY) tools/deps.py lowest)
	touch $@

test-lowest: wheel $(VENV_LOWEST)/.deps-installed
	$(PY_LOWEST) -m pip install --quiet --no-index --no-deps --force-reinstall dist/*_$(HOST_ARCH).whl
	VIRTUAL_ENV=$(abspath $(VENV_LOWEST)) PATH=$(abspath $(VENV_LOWEST))/bin:$$PATH \
		$(PY_LOWEST) -m pytest -q -p no:cacheprovider --timeout=$(PYTEST_TIMEOUT) $(PYTEST_PARALLEL) $(LOWEST_TESTS)

test: setup wheel cargo-test cargo-test-aarch64 lint pytest test-lowest

bench: setup
	$(PY) -m fastckpt.bench $(BENCH_ARGS)

# The object-storage scenario, against the Rust S3 server (built once) or moto.
BENCH_S3_ARGS ?= --size-mib 1024 --out benches/results
bench-s3: setup s3-server
	$(PY) -m fastckpt.bench s3 $(BENCH_S3_ARGS)

# Sharded checkpoints on object storage: 2 FSDP2 ranks, fastckpt.dcp against s3torchconnector's
# and DCP's fsspec writers/readers, on a local moto server (fastckpt.bench.s3_sharded).
BENCH_S3_SHARDED_ARGS ?= --size-mib 256 --repeat 3 --out benches/results
bench-s3-sharded: setup
	$(PY) -m fastckpt.bench s3-sharded $(BENCH_S3_SHARDED_ARGS)

# Tiers: a training loop checkpointing to a fast tier promoted to S3 / a throttled directory,
# against straight to them, and restores from each tier (fastckpt.bench.tiers, docs/tiers.md);
# then what a detached promoter costs and how soon it commits after a kill (bench.detached).
BENCH_TIERS_ARGS ?= --size-mib 256 --repeats 3 --out benches/results
bench-tiers: setup s3-server
	$(PY) -m fastckpt.bench tiers $(BENCH_TIERS_ARGS)
	$(PY) -m fastckpt.bench.detached --size-mib 256 --repeats 5 --out benches/results

# The Rust S3 server the object-storage benchmark prefers to moto (fastckpt.bench.s3
# --server auto): built once into .tools/ (ignored by git), for `make bench` only; without
# it (no cargo, no registry) the benchmark falls back to moto.
S3S_FS := .tools/bin/s3s-fs
s3-server: $(S3S_FS)
$(S3S_FS):
	@mkdir -p .tools && printf '*\n' > .tools/.gitignore
	cargo install s3s-fs --version 0.14.1 --features binary --locked --root .tools -j 2 \
		|| echo "==> s3s-fs did not build: the s3 benchmark will use moto"

clean:
	rm -rf target dist $(VENV) $(VENV_LOWEST) python/fastckpt/_native*.so
