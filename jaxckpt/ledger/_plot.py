"""The report's timeline as a picture (matplotlib: ``pip install 'jaxckpt[plot]'``).

Steps reached against wall time, one line per run; saves as dots on it (filled when
durable); each run's startup (from its process start, or the failure before, until
its first save call) shaded grey; each failure a red vertical line; each restore a
green triangle at the step it restored; the lost work of each restart shaded red
between the time the step it restored was reached and the failure. ``.png`` writes
the picture, ``.html`` a page with the picture (SVG, inline) and the report's figures.
"""

from __future__ import annotations

import html
import io
import json

from jaxckpt.ledger._report import Report


def _figure(r: Report) -> object:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = r.timeline
    fig, ax = plt.subplots(figsize=(11, 5))
    for i, points in enumerate(t.reached):
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, color="tab:blue", lw=1.5, label="steps reached" if i == 0 else None)
    for kind, fill in (("durable", "tab:blue"), ("local", "white")):
        saves = [(x, s) for x, s, tier in t.saves if tier == kind]
        if saves:
            xs, ys = zip(*saves, strict=True)
            ax.scatter(
                xs, ys, s=18, zorder=3, facecolor=fill, edgecolor="tab:blue", label=f"save ({kind})"
            )
    for i, (x0, x1) in enumerate(t.startup):
        ax.axvspan(x0, x1, color="tab:gray", alpha=0.15, lw=0, label="startup" if i == 0 else None)
    for i, x in enumerate(t.failures):
        ax.axvline(x, color="tab:red", ls="--", lw=1, label="failure" if i == 0 else None)
    if t.restores:
        xs, ys = zip(*t.restores, strict=True)
        ax.scatter(xs, ys, marker="^", s=50, color="tab:green", zorder=4, label="restore")
    for i, (x0, x1, s0, s1) in enumerate(t.lost):
        ax.fill_between(
            [x0, x1],
            [s0, s0],
            [s0, s1],
            color="tab:red",
            alpha=0.25,
            label="lost work" if i == 0 else None,
        )
    b = r.badput_s
    ax.set_title(
        f"{r.root}: goodput {r.goodput:.3f} over {r.wall_s:,.0f} s; badput: blocking "
        f"{b.save_blocking:.1f} s, restore {b.restore:.1f} s, lost {b.lost_work:.1f} s, "
        f"startup {b.startup:.1f} s",
        fontsize=9,
    )
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def plot(r: Report, path: str) -> None:
    """Draws ``r``'s timeline into ``path`` (``.png`` or ``.html``).

    Raises:
      ValueError: another suffix.
      ImportError: matplotlib is not installed.
    """
    lower = path.lower()
    if not lower.endswith((".png", ".html", ".htm")):
        raise ValueError(f"--plot takes a .png or .html file, got {path!r}")
    import matplotlib.pyplot as plt

    fig = _figure(r)
    try:
        if lower.endswith(".png"):
            fig.savefig(path, dpi=120)  # type: ignore[attr-defined]
            return
        svg = io.StringIO()
        fig.savefig(svg, format="svg")  # type: ignore[attr-defined]
        picture = svg.getvalue()
        picture = picture[picture.find("<svg") :]  # no XML prolog inside HTML
        body = json.dumps(r.to_json(), indent=2)
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                "<!doctype html><html><head><meta charset='utf-8'>"
                f"<title>jaxckpt report: {html.escape(r.root)}</title></head><body>"
                f"{picture}<pre>{html.escape(body)}</pre></body></html>\n"
            )
    finally:
        plt.close(fig)  # type: ignore[arg-type]
