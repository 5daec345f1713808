"""The dashboard's plots as inline SVG, drawn by matplotlib on the server: no script, no CDN."""

from __future__ import annotations

import io
import threading
from typing import Any

from ratchet.flows.journal import GenerationRow
from ratchet.flows.tracking import pyplot, success_figure

# pyplot keeps global state and the server renders pages on a thread pool: one figure at a time.
_PLOTTING = threading.Lock()


def success_svg(rows: list[GenerationRow]) -> str:
    """Success per generation per split: train (explore, sampled) and test (held-out, greedy),
    with the random policy's and the gold path's levels on the test tasks."""
    series: dict[str, list[tuple[int, float, float, float]]] = {}
    test = [(r.generation, r.test_success, *r.test_ci95) for r in rows if r.test_n and r.test_ci95]
    train = [
        (r.generation, r.explore_success, *r.explore_ci95)
        for r in rows
        if r.explore_success is not None and r.explore_ci95
    ]
    if test:
        series["test (held-out, greedy)"] = test  # type: ignore[assignment]
    if train:
        series["train (explore, sampled)"] = train  # type: ignore[assignment]
    if not series:
        return ""
    levels = [r for r in rows if r.random_success is not None or r.gold_success is not None]
    with _PLOTTING:
        fig = success_figure(series, "success per generation", ylabel="success (95% CI)")
        if levels:  # the bar the held-out line is read against: same tasks, same step budget
            last = levels[-1]
            ax = fig.axes[0]
            if last.random_success is not None:
                ax.axhline(
                    last.random_success, color="#888888", linestyle="--", label="random valid action (test)"
                )
            if last.gold_success is not None:
                ax.axhline(last.gold_success, color="#2a9d3a", linestyle=":", label="gold path (test)")
        if len(series) == 1 or levels:
            fig.axes[0].legend()
        return _svg(fig)


def cost_svg(rows: list[GenerationRow]) -> str:
    """Tokens (bars) and wall minutes (line) per generation."""
    if not rows:
        return ""
    with _PLOTTING:
        return _svg(_cost_figure(rows))


def _cost_figure(rows: list[GenerationRow]) -> Any:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    gens = [r.generation for r in rows]
    ax.bar(gens, [r.tokens / 1000 for r in rows], color="#8fb3d9", label="tokens (k)")
    ax.set_xticks(gens)
    ax.set_xlabel("generation")
    ax.set_ylabel("tokens (thousands)")
    wall = ax.twinx()
    wall.plot(gens, [r.wall_seconds / 60 for r in rows], color="#d8453b", marker="o", label="wall (min)")
    wall.set_ylabel("wall time (minutes)")
    wall.set_ylim(bottom=0)
    ax.set_title("cost per generation")
    handles = ax.get_legend_handles_labels()[0] + wall.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left")
    fig.tight_layout()
    return fig


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    pyplot().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]  # inline: drop the XML prolog and doctype
