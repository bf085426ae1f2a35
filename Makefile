# fastckpt: the one entry point for people, hooks and CI.
#   make setup   venv + Python deps (reused when present) + release build of the extension
#   make demo    setup, then run the demo on a small embedded example
#   make test    setup, then cargo tests, lints, pytest
#   make lint    cargo fmt --check, clippy -D warnings, ruff check/format, mypy
#   make bench   setup, then the benchmark harness (see BENCH_ARGS)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Python deps come from pyproject.toml (runtime + dev extras): one list, not two.
DEPS = $$($(PY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(" ".join(repr(d) for d in p["dependencies"] + p["optional-dependencies"]["dev"]))')
RUST_SOURCES := Cargo.toml Cargo.lock pyproject.toml $(wildcard rust/*.rs)
BENCH_ARGS ?= --size-gib 1.5 --repeats 3 --out benches/results

.PHONY: setup demo test lint bench cargo-test pytest clean

setup: $(VENV)/.fastckpt-built

# Reuses an existing venv and pip's cache; works from nothing on a fresh machine.
$(VENV)/.deps-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	eval $(PY) -m pip install --quiet $(DEPS)
	touch $@

$(VENV)/.fastckpt-built: $(VENV)/.deps-installed $(RUST_SOURCES)
	$(VENV)/bin/maturin develop --release --quiet
	touch $@

demo: setup
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

pytest: setup
	$(PY) -m pytest -q tests

test: setup cargo-test lint pytest

bench: setup
	$(PY) -m fastckpt.bench $(BENCH_ARGS)

clean:
	rm -rf target $(VENV) python/fastckpt/_native*.so
