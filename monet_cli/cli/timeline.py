"""Memory timelines as pictures: PNG through matplotlib (the ``plot`` extra) or a
self-contained HTML page with an inline SVG (no dependency)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from monet_cli.core.yamlio import atomic_write_text
from monet_cli.errors import UsageError

MIB = 2**20
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


@dataclass(frozen=True, kw_only=True, slots=True)
class Series:
    label: str
    values: tuple[int, ...]
    """Live bytes, one value per event in step order."""


def write_timeline(path: Path, title: str, series: list[Series], budget_bytes: int | None) -> None:
    """Live memory over the step (x: progress through the step, 0-100%), with the budget line."""
    suffix = Path(path).suffix.lower()
    if suffix == ".html":
        atomic_write_text(Path(path), _html(title, series, budget_bytes))
    elif suffix in (".png", ".svg", ".pdf"):
        _matplotlib(Path(path), title, series, budget_bytes)
    else:
        raise UsageError(f"--timeline {path}: use a .html, .png, .svg or .pdf file name")


def _progress(n: int) -> list[float]:
    return [100.0 * i / max(1, n - 1) for i in range(n)]


def _matplotlib(path: Path, title: str, series: list[Series], budget_bytes: int | None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UsageError(
            f"--timeline {path}: PNG needs matplotlib (pip install 'monet-cli[plot]'), or use .html"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for s, color in zip(series, _COLORS):
        ax.plot(_progress(len(s.values)), [v / MIB for v in s.values], label=s.label, color=color, linewidth=1.2)
    if budget_bytes is not None:
        ax.axhline(budget_bytes / MIB, color="red", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("progress through the step (%): forward, then backward and optimizer")
    ax.set_ylabel("live memory (MiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def _html(title: str, series: list[Series], budget_bytes: int | None) -> str:
    width, height, pad = 900, 360, 50
    top = max([max(s.values, default=0) for s in series] + [budget_bytes or 0, 1])

    def x(i: int, n: int) -> float:
        return pad + (width - 2 * pad) * i / max(1, n - 1)

    def y(v: int) -> float:
        return height - pad - (height - 2 * pad) * v / top

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#444"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#444"/>',
        f'<text x="{pad}" y="{pad - 10}">{top / MIB:,.1f} MiB</text>',
        f'<text x="{width / 2 - 150}" y="{height - 15}">progress through the step: forward, backward, optimizer</text>',
    ]
    for n, (s, color) in enumerate(zip(series, _COLORS)):
        points = " ".join(f"{x(i, len(s.values)):.1f},{y(v):.1f}" for i, v in enumerate(s.values))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.3" points="{points}"/>')
        parts.append(
            f'<text x="{width - pad - 200}" y="{pad + 16 * n}" fill="{color}">{html.escape(s.label)}: peak '
            f"{max(s.values, default=0) / MIB:,.1f} MiB</text>"
        )
    if budget_bytes is not None:
        parts.append(
            f'<line x1="{pad}" y1="{y(budget_bytes):.1f}" x2="{width - pad}" y2="{y(budget_bytes):.1f}" '
            f'stroke="red" stroke-dasharray="6,4"/><text x="{pad + 5}" y="{y(budget_bytes) - 4:.1f}" '
            f'fill="red">budget {budget_bytes / MIB:,.1f} MiB</text>'
        )
    parts.append("</svg>")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body><h3>{html.escape(title)}</h3>{''.join(parts)}</body></html>\n"
    )


def plot_points(path: Path, title: str, points: list[tuple[int, float, str]]) -> None:
    """The trade-off curve of a sweep: overhead (%) against peak memory (MiB)."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"--plot {path}: needs matplotlib (pip install 'monet-cli[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p[0] / MIB for p in points]
    ys = [100 * p[1] for p in points]
    ax.plot(xs, ys, marker="o")
    for x, y, label in zip(xs, ys, (p[2] for p in points)):
        ax.annotate(label, (x, y), fontsize=8, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("predicted peak memory (MiB)")
    ax.set_ylabel("predicted step-time overhead (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
