# fastckpt: the one entry point for people, hooks and CI.
#   make setup   venv + Python deps (reused when present) + release build of the extension
#   make demo    setup, then run the demo on a small embedded example
#   make wheel   the release wheel (manylinux2014, built with zig from PyPI) under dist/
#   make test    setup + wheel, then cargo tests, lints, pytest (tests/test_wheel.py installs
#                the wheel in a clean venv without Rust)
#   make lint    cargo fmt --check, clippy -D warnings, ruff check/format, mypy
#   make bench   setup, then the benchmark harness (see BENCH_ARGS)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Python deps come from pyproject.toml (runtime + every extra): one list, not two.
DEPS = $$($(PY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(" ".join(repr(d) for d in p["dependencies"] + [d for extra in p["optional-dependencies"].values() for d in extra]))')
RUST_SOURCES := Cargo.toml Cargo.lock pyproject.toml $(wildcard rust/*.rs)
PY_SOURCES := $(shell find python -name '*.py' -o -name '*.pyi' -o -name 'py.typed')
WHEEL_TAG := manylinux2014
BENCH_ARGS ?= --size-gib 1.5 --repeats 3 --out benches/results

.PHONY: setup demo wheel test lint bench cargo-test pytest clean s3-server

setup: $(VENV)/.fastckpt-built

# Only CPython 3.11 is supported (pyproject.toml's requires-python): check the venv's
# interpreter before installing anything into it.
$(VENV)/.python-checked:
	@test -x $(PY) || { echo "==> creating $(VENV) with $$($(PYTHON) --version)"; $(PYTHON) -m venv $(VENV); }
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "fastckpt needs CPython 3.11, $(VENV) has " + sys.version.split()[0] + ": remove $(VENV) and run make PYTHON=python3.11 ...")'
	@touch $@

# Reuses an existing venv and pip's cache; works from nothing on a fresh machine.
$(VENV)/.deps-installed: pyproject.toml $(VENV)/.python-checked
	@echo "==> upgrading pip"
	$(PY) -m pip install --quiet --upgrade pip
	@echo "==> installing the Python dependencies (the first run downloads torch, a few GB)"
	eval $(PY) -m pip install --progress-bar on $(DEPS)
	touch $@

# The distribution was called `fastckpt` before it became `fastckpt-io`: an old development
# install of that name is removed first so that two records never own the same files.
$(VENV)/.fastckpt-built: $(VENV)/.deps-installed $(RUST_SOURCES)
	@echo "==> building the Rust extension (release) into $(VENV)"
	$(PY) -m pip uninstall --yes --quiet fastckpt 2>/dev/null || true
	$(VENV)/bin/maturin develop --release
	touch $@

# One wheel, built once and reused by tests/test_wheel.py (FASTCKPT_WHEEL).
dist/.wheel-built: $(VENV)/.deps-installed $(RUST_SOURCES) $(PY_SOURCES) README.md LICENSE
	@echo "==> building the release wheel for $(WHEEL_TAG) with zig"
	rm -f dist/*.whl
	$(VENV)/bin/maturin build --release --zig --compatibility $(WHEEL_TAG) -i $(PY) --out dist
	touch $@

wheel: dist/.wheel-built

demo: setup
	@echo "==> running the demo"
	$(PY) -m fastckpt.demo

cargo-test:
	cargo test --quiet

lint: setup
	cargo fmt --check
	cargo clippy --all-targets --features python -- -D warnings
	cargo clippy --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests tools $(wildcard benches/*.py)
	$(VENV)/bin/ruff format --check python tests tools $(wildcard benches/*.py)
	$(VENV)/bin/mypy

pytest: setup wheel
	FASTCKPT_WHEEL="$$(ls dist/*.whl)" $(PY) -m pytest -q tests

test: setup wheel cargo-test lint pytest

bench: setup s3-server
	$(PY) -m fastckpt.bench $(BENCH_ARGS)

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
	rm -rf target dist $(VENV) python/fastckpt/_native*.so
