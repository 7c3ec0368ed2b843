"""Interactive charts of the run report with plotly (hover values, zoom, pan), fully offline.

Used when the optional ``plotly`` package is installed (``pip install 'stalwart[report]'``).
plotly.js is read from the installed package (`plotly.offline.get_plotlyjs`) and inlined once in
the page, so the report stays one HTML file that opens without a network; each chart is a
``<div>`` plus a ``Plotly.newPlot`` call. Without plotly the report uses
`stalwart.report.svg` (same charts, static).
"""

from __future__ import annotations

import math
from typing import Any

import stalwart.report.svg as svg
from stalwart.observability.run_dir import EventKind
from stalwart.report.iteration_charts import XMaps, trace_meta
from stalwart.report.svg import KIND_COLOURS, PALETTE, Points, series_colours

_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["toImage"]}
_LAYOUT: dict[str, Any] = dict(
    height=320,
    margin=dict(l=70, r=20, t=20, b=45),
    template="plotly_white",
    hovermode="x unified",
    legend=dict(orientation="h", y=-0.2),
)


def available() -> bool:
    """Whether plotly can be imported."""
    try:
        import plotly.graph_objects  # noqa: F401
    except ImportError:
        return False
    return True


def plotly_js() -> str:
    """plotly.js (minified) from the installed package, safe inside a ``<script>`` element."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().replace("</script", "<\\/script")


class PlotlyCharts:
    """Chart builders returning HTML fragments (a ``<div>`` and its script)."""

    interactive = True

    def __init__(self) -> None:
        self._count = 0

    def _html(self, fig: Any, height: int | None = None) -> str:
        import plotly.io as pio

        self._count += 1
        layout = dict(_LAYOUT)
        if height is not None:
            layout["height"] = height
        fig.update_layout(**layout)
        return str(
            pio.to_html(
                fig,
                full_html=False,
                include_plotlyjs=False,
                include_mathjax=False,
                config=_CONFIG,
                div_id=f"chart-{self._count}",
            )
        )

    def line(
        self,
        data: dict[str, Points],
        xlabel: str,
        ylabel: str,
        x_max: float | None = None,
        dashed: frozenset[str] = frozenset(),
        xmaps: XMaps | None = None,
        smooth: frozenset[str] = frozenset(),
    ) -> str:
        """One trace per series; non-finite values are gaps; one-point series get markers.
        ``x_max``: the x axis reaches at least this (the run's last iteration); ``dashed``:
        names of series drawn dashed (validation next to training). ``xmaps``: the page's
        controls apply to these traces (their other x axes; `iteration_charts.trace_meta`),
        the EMA to the series named in ``smooth``."""
        import plotly.graph_objects as go

        fig = go.Figure()
        data = {k: v for k, v in data.items() if v}
        for (name, pts), colour in zip(data.items(), series_colours(list(data), dashed)):
            ys = [y if math.isfinite(y) else None for _, y in pts]
            sparse = len(pts) <= 20
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in pts],
                    y=ys,
                    name=name,
                    mode="lines+markers" if sparse else "lines",
                    line=dict(color=colour, dash="dash" if name in dashed else "solid"),
                    meta=None if xmaps is None else trace_meta(pts, xmaps, name in smooth),
                )
            )
        fig.update_xaxes(title_text=xlabel, range=_x_range(data, x_max))
        fig.update_yaxes(title_text=ylabel)
        return self._html(fig)

    def stacked_bars(
        self, labels: list[str], stacks: dict[str, list[float]], ylabel: str, xlabel: str = ""
    ) -> str:
        import plotly.graph_objects as go

        fig = go.Figure()
        for (name, vals), colour in zip(stacks.items(), PALETTE * 4):
            fig.add_trace(go.Bar(x=labels, y=vals, name=name, marker_color=colour))
        fig.update_layout(barmode="stack", hovermode="x")
        fig.update_xaxes(title_text=xlabel, type="category")
        fig.update_yaxes(title_text=ylabel)
        return self._html(fig)

    def heatmap(self, records: list[dict[str, Any]]) -> str:
        """Ranks × reports, compute time over the median: grey at 1, red slow, blue fast."""
        import plotly.graph_objects as go

        rows = [r for r in records if isinstance(r.get("compute_ms"), list) and r["compute_ms"]]
        ranks = max(len(r["compute_ms"]) for r in rows)
        z: list[list[float | None]] = [[None] * len(rows) for _ in range(ranks)]
        text: list[list[str]] = [[""] * len(rows) for _ in range(ranks)]
        threshold = 1.2
        for c, rec in enumerate(rows):
            med = float(rec.get("median_ms") or 0.0) or 1.0
            threshold = float(rec.get("threshold") or threshold)
            for r, ms in enumerate(rec["compute_ms"]):
                z[r][c] = float(ms) / med
                text[r][c] = f"{float(ms):.2f} ms"
        lo, hi = 0.8, max(threshold, 1.0 + 1e-3)
        fig = go.Figure(
            go.Heatmap(
                z=z,
                x=[str(r.get("iteration")) for r in rows],
                y=[f"rank {r}" for r in range(ranks)],
                text=text,
                zmin=lo,
                zmax=hi,
                colorscale=[
                    [0.0, "rgb(49,130,189)"],
                    [(1.0 - lo) / (hi - lo), "rgb(189,189,189)"],
                    [1.0, "rgb(214,39,40)"],
                ],
                colorbar=dict(title=dict(text="× median")),
                hovertemplate="iteration %{x}, %{y}: %{text} (%{z:.2f}× median)<extra></extra>",
                xgap=1,
                ygap=1,
            )
        )
        fig.update_xaxes(title_text="iteration", type="category")
        fig.update_yaxes(autorange="reversed")
        fig.update_layout(hovermode="closest")
        return self._html(fig, height=max(220, min(600, 80 + 22 * ranks)))

    def timeline(self, events: list[dict[str, Any]], x_max: float | None) -> str:
        import plotly.graph_objects as go

        kinds = [k.value for k in EventKind]
        fig = go.Figure()
        for kind in kinds:
            evs = [e for e in events if str(e.get("kind")) == kind]
            fig.add_trace(
                go.Scatter(
                    x=[float(e.get("iteration", 0)) for e in evs],
                    y=[kind] * len(evs),
                    mode="markers",
                    name=kind,
                    marker=dict(size=11, color=KIND_COLOURS[kind]),
                    text=[str(e.get("detail", "")) for e in evs],
                    hovertemplate="iteration %{x}: %{text}<extra>" + kind + "</extra>",
                )
            )
        fig.update_yaxes(categoryorder="array", categoryarray=kinds[::-1], type="category")
        last = max([x_max or 0.0, 1.0, *(float(e.get("iteration", 0)) for e in events)])
        fig.update_xaxes(title_text="iteration", range=[0, last * 1.02])
        fig.update_layout(hovermode="closest", showlegend=False)
        return self._html(fig, height=300)


def _x_range(data: dict[str, Points], x_max: float | None) -> list[float] | None:
    """The x axis from the first point to ``x_max`` (or the last point), 1 % padding; None:
    plotly's autorange (no points, nothing to extend)."""
    xs = [x for pts in data.values() for x, _ in pts]
    if x_max is None or not xs:
        return None
    lo, hi = min(xs), max([*xs, x_max])
    pad = (hi - lo) * 0.01 or 1.0
    return [lo - pad, hi + pad]


class SvgCharts:
    """The static fallback with the same methods (inline SVG, `stalwart.report.svg`)."""

    interactive = False

    @staticmethod
    def line(
        data: dict[str, Points],
        xlabel: str,
        ylabel: str,
        x_max: float | None = None,
        dashed: frozenset[str] = frozenset(),
        xmaps: XMaps | None = None,
        smooth: frozenset[str] = frozenset(),
    ) -> str:
        """`svg.line_chart` (static: no controls, so ``xmaps`` and ``smooth`` do nothing)."""
        return svg.line_chart(data, xlabel, ylabel, x_max, dashed)

    stacked_bars = staticmethod(svg.stacked_bars)
    heatmap = staticmethod(svg.straggler_heatmap)
    timeline = staticmethod(svg.timeline)


Charts = PlotlyCharts | SvgCharts


def make_charts(interactive: bool | None = None) -> Charts:
    """Plotly charts when ``interactive`` (None: when plotly is installed), else SVG."""
    if interactive is None:
        interactive = available()
    if interactive and not available():
        raise ImportError("interactive report charts need plotly: pip install 'stalwart[report]'")
    return PlotlyCharts() if interactive else SvgCharts()
