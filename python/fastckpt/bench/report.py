"""Presenting results: terminal table, JSON, markdown and a PNG chart.

All four are rendered from the results dict that :func:`fastckpt.bench.harness.run` returns.
Figures are "median (min-max)" over the repetitions; durations also get their 90th percentile
and spread (max - min) in columns of their own, so a bimodal writer cannot hide behind its
median.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

__all__ = [
    "PLOT_MISSING",
    "Table",
    "plotting_available",
    "render_markdown",
    "render_text",
    "tables",
    "write_outputs",
    "write_png",
]


#: Columns of the terminal report.
TEXT_WIDTH = 100


#: A cell's ``" (min-max)"`` range (left out of the terminal table when it does not fit).
_RANGE = re.compile(r" \([^()]*\)$")


def _widths(headers: list[str], rows: list[list[str]]) -> list[int]:
    return [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]


def _width(headers: list[str], rows: list[list[str]]) -> int:
    return sum(_widths(headers, rows)) + 2 * (len(headers) - 1)


class Table:
    """A titled table that renders as aligned text or as markdown."""

    def __init__(
        self, title: str, headers: list[str], rows: list[list[str]], notes: list[str] | None = None
    ) -> None:
        self.title = title
        self.headers = headers
        self.rows = rows
        self.notes = notes or []

    def _widths(self) -> list[int]:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], len(cell))
        return widths

    def text(self, width: int = TEXT_WIDTH) -> str:
        """Aligned plain text with a rule under the header, at most ``width`` columns. A wider
        table shows medians only (its ``(min-max)`` ranges stay in the markdown report), then
        leaves out its last columns (named under it), keeping at least three; one still too
        wide is shown one row per paragraph (``name: header value; ...``, wrapped). Notes are
        wrapped."""
        headers, rows = self.headers, self.rows
        dropped: list[str] = []
        if _width(headers, rows) > width:
            rows = [[_RANGE.sub("", cell) for cell in row] for row in rows]
            while _width(headers, rows) > width and len(headers) > 3:
                dropped.insert(0, headers[-1])
                headers, rows = headers[:-1], [row[:-1] for row in rows]
        lines = [self.title]
        if _width(headers, rows) <= width:
            widths = _widths(headers, rows)
            lines.append("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
            lines.append("  ".join("-" * w for w in widths))
            for row in rows:
                padded = (c.ljust(w) for c, w in zip(row, widths, strict=True))
                lines.append("  ".join(padded).rstrip())
            if dropped:
                lines.append(f"(medians; {', '.join(dropped)} and the ranges: see the .md report)")
            elif rows != self.rows:
                lines.append("(medians; the ranges: see the .md report)")
        else:
            for name, *cells in self.rows:
                pairs = [f"{h} {c}" for h, c in zip(self.headers[1:], cells, strict=True) if c]
                lines += textwrap.wrap(
                    f"{name}: " + "; ".join(pairs),
                    width,
                    initial_indent="  ",
                    subsequent_indent="      ",
                    break_on_hyphens=False,
                )
        for note in self.notes:
            lines += textwrap.wrap(f"note: {note}", width, subsequent_indent="  ")
        return "\n".join(lines)

    def markdown(self) -> str:
        """A GitHub-flavoured markdown table under a ``###`` heading."""
        widths = self._widths()

        def line(cells: list[str]) -> str:
            return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

        out = [f"### {self.title}", "", line(self.headers)]
        out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        out.extend(line(row) for row in self.rows)
        if self.notes:
            out.append("")
            out.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(out)


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _range(summary: dict[str, Any] | None, digits: int = 3) -> str:
    if not summary or summary.get("median") is None:
        return "-"
    return (
        f"{summary['median']:.{digits}f} ({summary['min']:.{digits}f}-{summary['max']:.{digits}f})"
    )


def _tail(summary: dict[str, Any] | None, digits: int = 3) -> list[str]:
    """The p90 and spread cells of a duration summary (``-`` where absent, e.g. in results
    written before the harness recorded them)."""
    if not summary or summary.get("p90") is None:
        return ["-", "-"]
    return [_num(summary["p90"], digits), _num(summary.get("spread"), digits)]


def _write_rows(results: dict[str, Any]) -> list[list[str]]:
    writers = results["writers"]
    memory = results.get("memory", {}).get("writers", {})
    ceiling = writers.get("ceiling", {}).get("gib_per_s", {}).get("median")
    rows = []
    for name, entry in writers.items():
        if not entry["available"]:
            rows.append([name, entry["status"], "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        gibs = entry["gib_per_s"]["median"]
        mem = memory.get(name, {})
        peak = mem.get("peak_extra_mib") if mem.get("available") else None
        stall = _range(entry["stall_seconds"]) if entry.get("async") else "= total"
        returned = entry.get("returned_seconds")
        returned_cell = (
            (_num(returned["median"]) if returned else "-") if entry.get("async") else "= total"
        )
        rows.append(
            [
                name,
                _range(entry["seconds"]),
                *_tail(entry["seconds"]),
                _range(entry["gib_per_s"], 2),
                stall,
                returned_cell,
                _num(gibs / ceiling if ceiling else None, 2),
                _num(peak, 0),
                _write_mode(entry),
            ]
        )
    return rows


def _read_rows(results: dict[str, Any]) -> list[list[str]]:
    readers = results["readers"]
    ceiling = readers.get("ceiling", {}).get("gib_per_s", {}).get("median")
    rows = []
    for name, entry in readers.items():
        if not entry["available"]:
            rows.append([name, entry["status"], "-", "-", "-", "-", "-", "-"])
            continue
        gibs = entry["gib_per_s"]["median"]
        verified = {True: "yes", False: "NO", None: "-"}[entry.get("verified")]
        rows.append(
            [
                name,
                _range(entry["seconds"]),
                *_tail(entry["seconds"]),
                _range(entry["gib_per_s"], 2),
                _num(gibs / ceiling if ceiling else None, 2),
                str(entry.get("cache", "")),
                verified,
            ]
        )
    return rows


def _training_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, entry in results.get("training", {}).get("scenarios", {}).items():
        if not entry["available"]:
            rows.append([name, entry["status"], "-", "-", "-", "-", "-", "-", "-"])
            continue
        overhead = entry.get("overhead")
        of_medians = entry.get("overhead_of_medians")
        in_run = (entry.get("in_run_overhead") or {}).get("median")
        rows.append(
            [
                name,
                _range(entry["steps_per_s"], 2),
                _num(entry.get("ratio_vs_none"), 3),
                "-" if overhead is None else f"{overhead * 100:+.1f} %",
                "-" if of_medians is None else f"{of_medians * 100:+.1f} %",
                "-" if in_run is None else f"{in_run * 100:+.1f} %",
                _range(entry.get("stall_seconds_per_checkpoint")),
                _tail(entry.get("stall_seconds_per_checkpoint"))[0],
                _range(entry.get("lock_wait_seconds")),
            ]
        )
    return rows


def _bar_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for row in results.get("bar", []):
        value = row["value"]
        cell = "-" if value is None else f"{value:.3f}"
        status = row["status"] + (f" ({row['note']})" if row["note"] else "")
        rows.append([row["figure"], row["check"], cell, status])
    return rows


def _above_ceiling(entries: dict[str, Any], what: str) -> list[str]:
    """Notes naming the entries whose median beats the ceiling by more than 5 %."""
    ceiling = entries.get("ceiling", {})
    if not ceiling.get("available"):
        return []
    level = ceiling["gib_per_s"]["median"]
    faster = [
        f"{name} ({entry['gib_per_s']['median'] / level:.2f}x)"
        for name, entry in entries.items()
        if name != "ceiling" and entry["available"] and entry["gib_per_s"]["median"] > 1.05 * level
    ]
    if not faster:
        return []
    return [
        f"{', '.join(faster)} beat the {what} ceiling: on this disk it is a reference point, "
        "not an upper bound."
    ]


def _status_notes(entries: dict[str, Any]) -> list[str]:
    """A note per entry that did not run (not available, or failed), with its reason."""
    return [
        f"{name} {entry['status']}: {entry.get('reason') or 'no reason recorded'}"
        for name, entry in entries.items()
        if not entry["available"]
    ]


def _tc_notes(entries: dict[str, Any], writes: bool) -> list[str]:
    """What the torch_checkpointing rows ran with, where the table has any."""
    names = [n for n in entries if n.startswith("tc")]
    if not names:
        return []
    versions = {
        str(run["details"]["version"])
        for name in names
        for run in entries[name].get("runs", [])
        if "version" in run.get("details", {})
    }
    version = f" {', '.join(sorted(versions))}" if versions else ""
    storage = "LocalFileSystemStorageConfig(use_direct_io=False) (buffered)"
    if not writes:
        return [
            f"{', '.join(names)}: torch_checkpointing{version} load(into=) of its own sync save "
            f"of the state as one item {{'state': ...}}, with {storage}."
        ]
    return [
        f"{', '.join(names)}: torch_checkpointing{version}, the state saved as one item "
        f"{{'state': ...}} like the fastckpt-manager rows, with {storage}, except tc-direct: "
        "its default storage (O_DIRECT writes). It does not fsync; the harness does, inside "
        "the timed region. The tc-async writer subprocess's memory is not in peak +RSS."
    ]


#: What the stall columns of the write table mean.
STALL_NOTE = (
    "stall s: until the caller may change the state again (async writers: the save call "
    "returned and the snapshot is captured: manager.lock() taken for fastckpt-async and "
    "tc-async, staging done for dcp-async); save() returns s: until the save call returned, "
    "while the snapshot may still be being captured (not a stall)."
)


def _read_notes(results: dict[str, Any]) -> list[str]:
    """What the cache label of the read table means."""
    cache = results["cache"]
    if cache["cold"]:
        return ["cold: the page cache was dropped before every timed read."]
    if cache.get("prewarmed"):
        return [
            "warm: every input was read once, untimed, before the timed reads, so all are "
            "read from the page cache (not only those their write left there)."
        ]
    return []


def tables(results: dict[str, Any]) -> list[Table]:
    """The report's tables: writes, reads, memory, training loop, bar."""
    out = [
        Table(
            "Durable writes",
            [
                "writer",
                "seconds",
                "p90 s",
                "spread s",
                "GiB/s",
                "stall s",
                "save() returns s",
                "x ceiling",
                "peak +RSS MiB",
                "notes",
            ],
            _write_rows(results),
            [
                STALL_NOTE,
                *_above_ceiling(results["writers"], "write"),
                *_tc_notes(results["writers"], writes=True),
                *_status_notes(results["writers"]),
            ],
        ),
        Table(
            f"Reads ({results['cache']['label']} cache)",
            ["reader", "seconds", "p90 s", "spread s", "GiB/s", "x ceiling", "cache", "verified"],
            _read_rows(results),
            _read_notes(results)
            + _above_ceiling(results["readers"], "read")
            + _tc_notes(results["readers"], writes=False)
            + _status_notes(results["readers"]),
        ),
    ]
    repeated = results.get("memory", {}).get("async_repeated", {})
    if repeated.get("available"):
        rss = ", ".join(f"{v:.0f}" for v in repeated["rss_after_saves_mib"])
        out.append(
            Table(
                f"RSS after each of {repeated['saves']} fastckpt async saves (MiB)",
                ["RSS", "growth"],
                [[rss, f"{repeated['growth_mib']:+.1f} MiB"]],
            )
        )
    if results.get("training", {}).get("scenarios"):
        tc = results["training"]["config"]
        out.append(
            Table(
                f"Training loop ({tc['steps']} steps, checkpoint every {tc['every']}, "
                f"MLP {tc['layers']}x{tc['hidden']}, batch {tc['batch']})",
                [
                    "scenario",
                    "steps/s",
                    "vs none",
                    "overhead (paired)",
                    "overhead of medians",
                    "in-run overhead",
                    "stall s / ckpt",
                    "p90 stall s",
                    "lock wait s / run",
                ],
                _training_rows(results),
                [
                    "overhead (paired): median over runs of the loss against the mean of the "
                    "baseline runs just before and after each run (drift in load cancels); "
                    "overhead of medians: 1 - median steps/s / median baseline steps/s; "
                    "in-run overhead: median over runs of the time the steps overlapping a "
                    "checkpoint took beyond the median of the same run's other steps, plus the "
                    "save calls, as a share of the run (a slowdown of steps that overlap no "
                    "checkpoint is not counted). stall s / ckpt: what the training thread waited "
                    "for a checkpoint: the save call plus the waits to take the lock (guard) "
                    "in the steps until the next checkpoint (the snapshot being captured)."
                ],
            )
        )
    out.append(
        Table(
            "Bar (docs/performance.md)", ["figure", "check", "value", "status"], _bar_rows(results)
        )
    )
    return out


def _preamble(results: dict[str, Any]) -> list[str]:
    env = results["environment"]
    state = results["state"]
    fs = env["filesystem"]
    cache = results["cache"]
    return [
        f"State: {state['gib']:.3f} GiB ({state['tensors']} tensors, {state['dtype']}: weights "
        f"+ Adam exp_avg/exp_avg_sq), {results['config']['repeats']} repetitions, "
        "median (min-max); p90 = 90th percentile (linear between ranks), spread = max - min.",
        f"Machine: {env['cpu_model']}, {env['cpu_count']} CPUs, {env['memory_gib']} GiB RAM; "
        f"files on {fs['mount']} ({fs['type']}, {fs['device']}); reads {cache['label']}"
        + (f" ({cache['reason']})" if cache["reason"] else "")
        + f"; 1-thread memcpy {results['memcpy']['gib_per_s']:.1f} GiB/s.",
        f"Versions: python {env['python']}, torch {env['torch']}, safetensors "
        f"{env['safetensors']}, numpy {env['numpy']}, fastckpt {env['fastckpt']}.",
        f"Run {results['created']} ({results['duration_s']:.0f} s), load average "
        f"{_load(env, 'start')} at start, {_load(env, 'end')} at end. Throughput = state bytes / "
        "time until durable (async writers: until the future resolved).",
    ]


def _load(env: dict[str, Any], when: str) -> str:
    values = env.get(f"load_average_{when}") or []
    return "/".join(f"{v:.2f}" for v in values) or "?"


def render_text(results: dict[str, Any]) -> str:
    """The terminal report, at most :data:`TEXT_WIDTH` columns."""
    parts = [f"fastckpt benchmark: {results['tag']}"]
    for line in _preamble(results):
        parts += textwrap.wrap(line, TEXT_WIDTH, subsequent_indent="  ")
    parts.append("")
    for table in tables(results):
        parts += [table.text(), ""]
    return "\n".join(parts)


def render_markdown(results: dict[str, Any]) -> str:
    """The markdown report (what ``<tag>.md`` holds)."""
    parts = [f"## fastckpt benchmark: {results['tag']}", "", *_preamble(results), ""]
    for table in tables(results):
        parts += [table.markdown(), ""]
    return "\n".join(parts)


def write_png(results: dict[str, Any], path: Path) -> None:
    """Bar chart of median write and read throughput (min-max whiskers), ceilings as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for ax, section, title, line in (
        (axes[0], "writers", "Durable save", "O_DIRECT write ceiling (1 stream)"),
        (
            axes[1],
            "readers",
            f"Load ({results['cache']['label']} cache)",
            "O_DIRECT read (4 streams)",
        ),
    ):
        entries = results[section]
        names = [n for n, e in entries.items() if e["available"] and n != "ceiling"]
        medians = [entries[n]["gib_per_s"]["median"] for n in names]
        lows = [m - entries[n]["gib_per_s"]["min"] for n, m in zip(names, medians, strict=True)]
        highs = [entries[n]["gib_per_s"]["max"] - m for n, m in zip(names, medians, strict=True)]
        colors = ["tab:blue" if n.startswith("fastckpt") else "tab:gray" for n in names]
        ax.bar(names, medians, yerr=[lows, highs], color=colors, capsize=4)
        ceiling = entries.get("ceiling", {})
        if ceiling.get("available"):
            level = ceiling["gib_per_s"]["median"]
            ax.axhline(level, color="tab:red", linestyle="--", label=f"{line}: {level:.2f}")
            ax.legend(loc="best")
        ax.set_title(title)
        ax.set_ylabel("GiB/s (median, min-max)")
        ax.tick_params(axis="x", labelrotation=35)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    state = results["state"]
    fs = results["environment"]["filesystem"]
    fig.suptitle(
        f"fastckpt benchmark {results['tag']}: {state['gib']:.2f} GiB state, "
        f"{results['config']['repeats']} reps, {fs['type']} on {fs['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict[str, Any], out: Path, plot: bool = True) -> dict[str, Path]:
    """Write ``<tag>.json``, ``<tag>.md`` and (if ``plot``) ``<tag>.png`` under ``out``.

    Returns:
        kind (``"json"``, ``"md"``, ``"png"``) -> path written.
    """
    out.mkdir(parents=True, exist_ok=True)
    tag = results["tag"]
    paths = {"json": out / f"{tag}.json", "md": out / f"{tag}.md"}
    paths["json"].write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    paths["md"].write_text(render_markdown(results))
    if plot:
        if plotting_available():
            paths["png"] = out / f"{tag}.png"
            write_png(results, paths["png"])
        else:
            print(f"skipped {tag}.png: {PLOT_MISSING}", file=sys.stderr)
    return paths


#: What to do when the chart cannot be drawn (matplotlib is an optional extra).
PLOT_MISSING = (
    "matplotlib is not installed; install the 'plot' extra (pip install 'fastckpt-io[plot]') "
    "for the PNG chart, or pass --no-plot"
)


def plotting_available() -> bool:
    """Whether matplotlib can be imported (the ``plot`` extra), without importing it."""
    return importlib.util.find_spec("matplotlib") is not None


def _write_mode(entry: dict[str, Any]) -> str:
    """ "O_DIRECT" / "buffered" for writers that report the mode they used, else ""."""
    direct = entry.get("details", {}).get("direct_io")
    return "" if direct is None else ("O_DIRECT" if direct else "buffered")
