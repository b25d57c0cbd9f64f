"""The report: markdown tables and the chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchkit.common import CONTENDERS, LOOP_CONTENDERS, WRITER_NICE, Case, _ratio
from benchkit.summary import PACKED_SUFFIX, _get


def _f(value: float | None, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{unit}"


def _cell(io: dict[str, Any], contender: str, key: str, scale: float = 1.0, digits: int = 2) -> str:
    entry = io.get(contender, {})
    if not entry.get("n"):
        return "error" if entry.get("errors") else "–"
    return _f(entry.get(key), scale, digits)


def _verdicts(summary: dict[str, Any], label: str, prefix: str = "") -> str:
    hits = [t for t in summary.get("targets", []) if t["target"] == label]
    return "; ".join(f"{prefix}{t['bound']} → **{t['verdict']}**" for t in hits) or ""


def _vs_text(summary: dict[str, Any], contender: str, key: str, others: tuple[str, ...]) -> str:
    """``contender``'s ``key`` as a multiple of each of ``others``' (``"0.52× raw, ..."``)."""
    names = {"raw": "raw", "orbax": "Orbax"}
    mine = _get(summary, contender, key)
    return ", ".join(f"{_f(_ratio(mine, _get(summary, o, key)))}× {names[o]}" for o in others)


def _io_rows(summary: dict[str, Any]) -> list[str]:
    io = summary["io"]
    # (row, key, scale, digits, ratios to (none, Orbax, or raw and Orbax), target labels)
    rows: list[tuple[str, str, float, int, tuple[str, ...], str]] = [
        ("save: blocking (ms)", "blocking_s", 1e3, 1, ("orbax",), "blocking time vs Orbax"),
        ("save: until committed (s)", "commit_s", 1.0, 3, (), ""),
        (
            "save throughput (GB/s)",
            "save_gbps",
            1.0,
            3,
            ("raw", "orbax"),
            "save throughput vs raw write+fsync|save throughput vs Orbax",
        ),
        (
            "restore throughput (GB/s)",
            "restore_gbps",
            1.0,
            3,
            ("raw", "orbax"),
            "restore throughput vs Orbax",
        ),
        (
            "peak extra RSS, save (× state)",
            "save_rss",
            1.0,
            2,
            (),
            "peak extra RSS during save / state",
        ),
        ("peak extra RSS, restore (× state)", "restore_rss", 1.0, 2, (), ""),
        ("bytes stored (× state)", "stored_ratio", 1.0, 3, (), ""),
    ]
    out = []
    for name, key, scale, digits, others, labels in rows:
        names = labels.split("|")
        verdicts = [_verdicts(summary, x) for x in names]
        verdicts += [_verdicts(summary, x + PACKED_SUFFIX, "packed: ") for x in names]
        verdict = "; ".join(filter(None, verdicts))
        cells = [_cell(io, c, key, scale, digits) for c in CONTENDERS]
        if key == "blocking_s":
            cells[0] = "(= commit)"
        ratios = [_vs_text(summary, c, key, others) for c in ("jaxckpt", "jaxckpt-packed")]
        out.append(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} | {verdict} |")
    return out


def _loop_rows(summary: dict[str, Any]) -> list[str]:
    loop = summary.get("loop")
    if not loop:
        return [f"| training loop | {summary.get('loop_skipped', 'not run')} | | | | | | |"]
    r, j, o, n = (loop.get(c, {}) for c in ("raw", "jaxckpt", "orbax", "jaxckpt-nice"))
    overhead = [_f(x.get("overhead_s_per_save"), 1e3, 1) for x in (r, j, o)]
    in_loop = [_f(x.get("blocking_s_in_loop"), 1e3, 1) for x in (r, j, o)]
    overhead.insert(2, "(not in the loop)")  # the jaxckpt-packed column
    in_loop.insert(2, "")
    nice = (
        f"; writer_nice={WRITER_NICE}: {_f(n.get('overhead_s_per_save'), 1e3, 1)} ms,"
        f" {_f(_ratio(n.get('overhead_s_per_save'), r.get('overhead_s_per_save')))}× the raw"
        " writer thread's"
        if n
        else ""
    )
    ratios = (
        f"{_f(_ratio(j.get('overhead_s_per_save'), j.get('blocking_s_alone')))}× its blocking"
        f" alone, {_f(_ratio(j.get('overhead_s_per_save'), r.get('overhead_s_per_save')))}×"
        f" the raw writer thread's overhead (Orbax"
        f" {_f(_ratio(o.get('overhead_s_per_save'), o.get('blocking_s_alone')))}× its blocking)"
        f"{nice}"
    )
    head = (
        f"training loop ({loop['saves']} saves, one every {loop['every']} steps of "
        f"{loop['step_ms']:.1f} ms, against as many steps without a save; raw = the raw writer"
        " on a background thread)"
    )
    verdict = _verdicts(summary, "training-loop overhead / blocking alone")
    return [
        f"| {head}: overhead per save (ms) | {' | '.join(overhead)} | {ratios} | | {verdict} |",
        f"| training loop: blocking per save in the loop (ms) | {' | '.join(in_loop)} | | | |",
    ]


def _store_rows(summary: dict[str, Any]) -> list[str]:
    stores = summary.get("stores")
    if not stores:
        return []
    out = [
        "",
        "Object stores on loopback (in-memory servers; the GCS emulator serves one request at a"
        " time; raw = TensorStore kvstore writes/reads of one object per leaf, all in flight;"
        " jaxckpt-*-ts = restores read through TensorStore, not jaxckpt's own connections;"
        " -lowmem = an 8 MiB restore budget; requests counted from the server's log):",
        "",
        "| store | blocking (ms) | save (s) | save (MB/s) | save vs raw | restore (s) |"
        " restore (MB/s) | restore vs raw | requests save / restore |"
        " peak extra RSS save / restore (× state) | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in stores.items():
        raw = stores.get("raw-" + name.split("-")[1], {}) if not name.startswith("raw") else {}
        errors = "; ".join(x.splitlines()[0][:120] for x in e.get("errors", []))
        cells = [
            _f(e.get("blocking_s"), 1e3, 1),
            _f(e.get("commit_s"), digits=3),
            _f(e.get("save_gbps"), 1e3, 1),
            f"{_f(_ratio(e.get('save_gbps'), raw.get('save_gbps')))}×" if raw else "",
            _f(e.get("restore_s"), digits=3),
            _f(e.get("restore_gbps"), 1e3, 1),
            f"{_f(_ratio(e.get('restore_gbps'), raw.get('restore_gbps')))}×" if raw else "",
            f"{_requests(e, 'save')} / {_requests(e, 'restore')}",
            f"{_f(e.get('save_rss'))} / {_f(e.get('restore_rss'))}",
            errors,
        ]
        out.append(f"| {name} | {' | '.join(cells)} |")
    return out


def _requests(entry: dict[str, Any], phase: str) -> str:
    total = entry.get(f"{phase}_requests")
    if total is None:
        return "–"
    by_method = entry.get(f"{phase}_requests_by_method") or {}
    detail = ", ".join(f"{k} {v}" for k, v in sorted(by_method.items()))
    return f"{total:g} ({detail})"


def _case_section(summary: dict[str, Any]) -> list[str]:
    case = Case(**summary["case"])
    lines = [f"### {case.label}", ""]
    if "skipped" in summary:
        return [*lines, f"Skipped: {summary['skipped']}.", ""]
    lines += [
        "| metric | raw write+fsync | jaxckpt | jaxckpt packed | Orbax | jaxckpt ratio"
        " | packed ratio | target |",
        "|---|---|---|---|---|---|---|---|",
        *_io_rows(summary),
        *_loop_rows(summary),
    ]
    errors = [
        f"- {c}: {e.splitlines()[0][:300]}"
        for c, entry in summary["io"].items()
        for e in entry.get("errors", [])
    ]
    if errors:
        lines += ["", "Errors:", *errors]
    wrong = [c for c, entry in summary["io"].items() if entry.get("incorrect")]
    if wrong:
        lines += ["", f"**Restored values differ from the saved ones:** {', '.join(wrong)}"]
    return [*lines, *_store_rows(summary), ""]


def _target_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = ["| case | target | measured | bound | result |", "|---|---|---|---|---|"]
    for summary in summaries:
        for t in summary.get("targets", []):
            lines.append(
                f"| {summary['case']['name']} | {t['target']} | {_f(t['value'])}× | {t['bound']} "
                f"| **{t['verdict']}** |"
            )
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    m, st = report["machine"], report["settings"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    lines = [
        "# jaxckpt benchmark: against the disk and against Orbax",
        "",
        f"- Date: {m['date']}",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.1f} GiB RAM; "
        f"disk {m['disk']}; Linux {m['kernel']}, Python {m['python']}",
        f"- Versions: {versions}; jaxckpt source: {m.get('jaxckpt_source', 'unknown')}",
        f"- Load average at start / end: {_load(m['load_at_start'])} / {_load(m['load_at_end'])}",
        f"- Repeats: {st['repeats']}, contenders interleaved ({', '.join(CONTENDERS)}), each "
        "measurement in a fresh process after a warm-up save; medians over repeats, peak memory "
        "is the worst repeat.",
        f"- Restore reads: {'from the disk (fsync + POSIX_FADV_DONTNEED on every file first, for all contenders)' if st['cold_cache'] else 'page cache left warm for all contenders'}.",  # noqa: E501
        f"- jaxckpt options: {st['jaxckpt_options'] or 'defaults'}; Orbax: "
        "`ocp.CheckpointManager` defaults + `StandardSave`.",
        "- Throughput is state bytes / seconds (save: from the call until committed).",
        "",
        "## Targets",
        "",
        *_target_table(report["cases"]),
        "",
        "## Cases",
        "",
    ]
    for summary in report["cases"]:
        lines += _case_section(summary)
    return "\n".join(lines) + "\n"


def _load(values: Any) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "?"


COLORS = {"raw": "#8c8c8c", "jaxckpt": "#1f77b4", "jaxckpt-packed": "#2ca02c", "orbax": "#ff7f0e"}
LIGHT = {"raw": "#cccccc", "jaxckpt": "#9ecae1", "jaxckpt-packed": "#a1d99b", "orbax": "#fdd0a2"}


def _bars(
    ax: Any,
    groups: list[str],
    series: dict[str, list[float | None]],
    title: str,
    *,
    log: bool = False,
) -> None:
    """Grouped bars; a series named ``"<contender> ..."`` gets the contender's colour."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        contender = name.split()[0]
        color = (LIGHT if "blocking" in name else COLORS).get(contender)
        heights = [v if v is not None else 0.0 for v in values]
        ax.bar(xs, heights, width, label=name, color=color)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def render_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [s for s in report["cases"] if "io" in s]
    groups = [s["case"]["name"] for s in done]

    def io_series(key: str, contenders: tuple[str, ...], scale: float = 1.0) -> dict[str, Any]:
        return {
            c: [None if (v := _get(s, c, key)) is None else v * scale for s in done]
            for c in contenders
        }

    def loop_series() -> dict[str, Any]:
        out: dict[str, list[float | None]] = {}
        for c in LOOP_CONTENDERS:
            if c != "raw":
                out[f"{c} blocking alone"] = [_loop_get(s, c, "blocking_s_alone") for s in done]
            out[f"{c} loop overhead"] = [_loop_get(s, c, "overhead_s_per_save") for s in done]
        return {k: [v * 1e3 if v is not None else None for v in vs] for k, vs in out.items()}

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    save, restore = io_series("save_gbps", CONTENDERS), io_series("restore_gbps", CONTENDERS)
    _bars(axes[0, 0], groups, save, "save throughput (GB/s, log)", log=True)
    _bars(axes[0, 1], groups, restore, "restore throughput (GB/s, log)", log=True)
    blocking = io_series("blocking_s", CONTENDERS[1:], 1e3)
    _bars(axes[0, 2], groups, blocking, "save blocking (ms, log)", log=True)
    _bars(axes[1, 0], groups, io_series("save_rss", CONTENDERS), "peak extra RSS, save (× state)")
    restore_rss = io_series("restore_rss", CONTENDERS)
    _bars(axes[1, 1], groups, restore_rss, "peak extra RSS, restore (× state)")
    _bars(axes[1, 2], groups, loop_series(), "training loop: ms per save (raw: writer thread)")
    axes[1, 0].axhline(1.25, color="red", lw=0.8, ls="--")
    fig.suptitle(f"jaxckpt vs raw disk vs Orbax — {report['machine']['date']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _loop_get(summary: dict[str, Any], contender: str, key: str) -> float | None:
    return summary.get("loop", {}).get(contender, {}).get(key)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "bench.md").write_text(render_markdown(report))
    render_chart(report, out / "bench.png")


# ---- main -----------------------------------------------------------------------------------
