#!/usr/bin/env bash
# Runs the committed benchmark configurations: a 1.5 GiB and a 4 GiB state, 3 repetitions each.
# Results land in benches/results/state-<size>gib.{json,md,png}. Extra arguments are passed to
# both runs (e.g. --dir /mnt/nvme/scratch to measure another disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
for size in 1.5 4; do
    "$PY" -m fastckpt.bench --size-gib "$size" --repeats 3 --drop-caches --out benches/results "$@"
done
