"""The report's pictures as PNG files: dev perplexity over training, Table 3's BLEU beside the paper's,
and attention heatmaps.

Drawn with matplotlib's object-oriented API on the Agg canvas, never through pyplot: no global
figure state and no display backend, so it runs the same in a Snakemake job, a test or a headless
node. matplotlib and numpy are imported inside the functions (``aiayn`` imports stay light).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from aiayn.writing import atomic_path

DPI = 120


def _figure(width: float, height: float, layout: str | None = "constrained"):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        # The temporary name has no .png suffix, so the format is given explicitly.
        figure.savefig(tmp, format="png", dpi=DPI)
    return path


def plot_dev_perplexity(curves: Mapping[str, Mapping[int, Sequence[tuple[int, float]]]], path: str | Path) -> Path:
    """Dev perplexity against training step (``dev_perplexity_figure``) as a PNG."""
    return _save(dev_perplexity_figure(curves), path)


def dev_perplexity_figure(curves: Mapping[str, Mapping[int, Sequence[tuple[int, float]]]]):
    """Dev perplexity against training step: one colour per preset, one line per seed.

    ``curves``: preset -> seed -> [(step, perplexity), ...]. Presets without points are listed in the
    title instead, so that a missing curve is visible rather than silently absent. The axis is
    logarithmic (perplexity falls by orders of magnitude early on), so the final values, the ones a
    reader compares, would sit between two labelled decades: each line's last value is written beside
    the axes in its colour, and the axis labels 2 and 5 of every decade too.
    """
    figure = _figure(8.0, 5.0)
    axes = figure.add_subplot()
    colours = [f"C{i}" for i in range(10)]
    missing = []
    finals = []  # (last perplexity, colour) of each line
    for index, (preset, seeds) in enumerate(curves.items()):
        seeds = {seed: sorted(points) for seed, points in seeds.items() if points}
        if not seeds:
            missing.append(preset)
            continue
        for number, (seed, points) in enumerate(sorted(seeds.items())):
            steps, perplexities = zip(*points)
            label = (preset if len(seeds) == 1 else f"{preset} ({len(seeds)} seeds)") if number == 0 else None
            colour = colours[index % len(colours)]
            axes.plot(steps, perplexities, color=colour, marker="o", markersize=3,
                      linewidth=1.2, linestyle=("-", "--", ":", "-.")[number % 4], label=label)
            finals.append((float(perplexities[-1]), colour))
    if finals:
        from matplotlib.ticker import FuncFormatter, NullFormatter

        axes.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        axes.yaxis.set_major_formatter(plain)
        low, high = axes.get_ylim()
        # Every minor tick labelled when the curves span little more than a decade; else 2 and 5 of each
        # decade (all eight would crowd), so that values between two decades can still be read off.
        one_two_five = FuncFormatter(lambda value, _: f"{value:g}" if _leading_digit(value) in (2, 5) else "")
        axes.yaxis.set_minor_formatter(plain if high / low < 20 else one_two_five if high / low < 1e4
                                       else NullFormatter())
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no dev evaluations found", ha="center", va="center", transform=axes.transAxes)
    axes.set_xlabel("training step")
    axes.set_ylabel("dev perplexity (per BPE token)")
    axes.grid(True, which="both", alpha=0.3)
    title = "Dev perplexity during training"
    if missing:
        title += f"\n(no dev evaluations for {', '.join(missing)})"
    axes.set_title(title)
    if finals:
        _label_final_values(figure, axes, finals)
    return figure


def plot_reference_band(preset: str, curves: Mapping[int, Sequence[tuple[int, float]]], reference: dict | None,
                        path: str | Path) -> Path:
    """One preset's runs (seed -> [(step, perplexity)]) over its reference's seed band, as a PNG."""
    return _save(reference_band_figure(preset, curves, reference), path)


def reference_band_figure(preset: str, curves: Mapping[int, Sequence[tuple[int, float]]], reference: dict | None):
    """Dev perplexity against step: the reference's band (lowest to highest seed) shaded, its mean dashed, an
    end point (the paper's) as a star, each run a line; logarithmic in perplexity. Under a curve reference a
    second panel shows each run and the band relative to the band's mean, where a narrow band can be read."""
    import textwrap

    import numpy as np
    from matplotlib.ticker import FuncFormatter

    band = []
    if reference is not None:
        band = [(point["step"], point["dev_ppl"]["low"], point["dev_ppl"]["mean"], point["dev_ppl"]["high"])
                for point in reference["points"] if point.get("dev_ppl")]
    curve_band = len(band) > 1 and reference.get("kind") != "end_point"
    figure = _figure(7.5, 6.5 if curve_band else 4.5)
    axes, relative = (figure.subplots(2, 1, sharex=True, height_ratios=[3, 2]) if curve_band
                      else (figure.add_subplot(), None))
    if band and not curve_band:
        for step, _, mean, _ in band:
            axes.plot([step], [mean], marker="*", markersize=14, color="black", linestyle="none",
                      label=f"reference end point: {mean:g} at step {step}")
    elif curve_band:
        steps, mean = _draw_band(axes, relative, band, reference)
    for number, (seed, points) in enumerate(sorted(curves.items())):
        if not points:
            continue
        run_steps, perplexities = (np.array(column, dtype=float) for column in zip(*sorted(points)))
        colour = f"C{number % 7}"  # C7 (grey) is the band's
        axes.plot(run_steps, perplexities, color=colour, marker="o", markersize=3, linewidth=1.4,
                  label=f"seed {seed}: {perplexities[-1]:.3g} at step {run_steps[-1]:.0f}")
        if curve_band:
            inside = (run_steps >= steps[0]) & (run_steps <= steps[-1])
            ratio = perplexities[inside] / np.interp(run_steps[inside], steps, mean)
            relative.plot(run_steps[inside], ratio, color=colour, marker="o", markersize=3, linewidth=1.4)
    axes.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.yaxis.set_major_formatter(plain)
    low_limit, high_limit = axes.get_ylim()
    axes.yaxis.set_minor_formatter(FuncFormatter(
        lambda value, _: f"{value:g}" if high_limit / low_limit < 20 or _leading_digit(value) in (2, 5) else ""))
    axes.set_ylabel("dev perplexity (per BPE token)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper right")
    (relative if curve_band else axes).set_xlabel("training step")
    if curve_band:
        _style_relative_axes(relative)
    source = reference.get("note", "") if reference else "no reference"
    figure.suptitle(f"{preset}: dev perplexity against its reference\n" + "\n".join(textwrap.wrap(source, 95)),
                    fontsize=10)
    return figure


def _draw_band(axes, relative, band: list[tuple], reference: dict):
    """A curve reference's band (widened by its tolerance) and mean on ``axes``, and relative to the mean on
    ``relative``; its steps and mean."""
    import numpy as np

    steps, low, mean, high = (np.array(column, dtype=float) for column in zip(*band))
    seeds = len(reference.get("seeds", []))
    label = f"reference band ({seeds} seed{'s' if seeds != 1 else ''}: lowest to highest)"
    tolerance = reference.get("tolerance", 0.0)
    for target, scale in ((axes, 1.0), (relative, mean)):
        target.fill_between(steps, low / scale, high / scale, color="C7", alpha=0.45, linewidth=0,
                            label=label if target is axes else None)
        if tolerance:
            target.fill_between(steps, low * (1 - tolerance) / scale, high * (1 + tolerance) / scale, color="C7",
                                alpha=0.18, linewidth=0,
                                label=f"widened by its tolerance, {tolerance:.0%}" if target is axes else None)
    axes.plot(steps, mean, color="0.3", linestyle="--", linewidth=1.0, label="reference mean")
    relative.axhline(1.0, color="0.3", linestyle="--", linewidth=1.0)
    return steps, mean


def _style_relative_axes(relative) -> None:
    """The relative panel on a log scale, ticked in percent from the mean: a run 100 times worse and a band of
    a few percent, both readable."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    relative.set_yscale("log")
    bottom, top = relative.get_ylim()
    ratios = [r for r in (0.01, 0.1, 0.25, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2, 3, 5, 10, 30, 100, 1000)
              if bottom <= r <= top]
    if len(ratios) < 4:  # a band of a few percent: ticks within it
        ratios = sorted(set(ratios) | {r for r in (0.9, 0.95, 1.05, 1.1) if bottom <= r <= top})
    relative.yaxis.set_major_locator(FixedLocator(ratios))
    relative.yaxis.set_minor_locator(NullLocator())
    relative.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{100 * (value - 1):+.0f}%"))
    relative.set_ylabel("against the reference mean")
    relative.grid(True, which="both", alpha=0.3)


def _leading_digit(value: float) -> int:
    """1 for 1, 10 and 0.1; 2 for 2, 20 and 0.2 (read off the rounded mantissa, as tick values are not exact)."""
    return int(round(value / 10 ** math.floor(math.log10(value) + 1e-9), 6)) if value > 0 else 0


FINAL_VALUE_FONTSIZE = 8


def _label_final_values(figure, axes, finals: Sequence[tuple[float, str]]) -> None:
    """Write each line's last value just right of the axes, at its height, in its colour. Values closer
    than a line of text are moved apart (the lowest first, none below the axes nor above them), so that
    no two overlap; the layout is run once with the labels at their own heights to learn the axes' size."""
    order = sorted(range(len(finals)), key=lambda index: finals[index][0])
    labels = [axes.annotate(f"{finals[index][0]:.3g}", xy=(1.0, finals[index][0]),
                            xycoords=("axes fraction", "data"), xytext=(4, 0), textcoords="offset points",
                            va="center", ha="left", fontsize=FINAL_VALUE_FONTSIZE, color=finals[index][1],
                            annotation_clip=False)
              for index in order]
    figure.draw_without_rendering()  # the constrained layout, now making room for the labels
    height_points = axes.get_window_extent().height * 72 / figure.dpi
    gap = 1.25 * FINAL_VALUE_FONTSIZE / height_points  # a line of text, as a fraction of the axes' height
    # heights as fractions of the (logarithmic) axis, pushed apart upwards, then back down from the top
    low, high = (math.log10(limit) for limit in axes.get_ylim())
    wanted = [(math.log10(finals[index][0]) - low) / (high - low) for index in order]
    placed = []
    for fraction in wanted:
        placed.append(max(fraction, placed[-1] + gap) if placed else fraction)
    top = 1.0
    for position in reversed(range(len(placed))):
        placed[position] = min(placed[position], top)
        top = placed[position] - gap
    for label, fraction in zip(labels, placed):
        label.xy = (1.0, 10 ** (low + fraction * (high - low)))


def plot_table3_bleu(labels: Sequence[str], ours: Sequence[float], ours_std: Sequence[float] | None,
                     paper: Sequence[float | None], path: str | Path, ylabel: str = "dev BLEU") -> Path:
    """Table 3 as bars: our dev BLEU (with the standard deviation over seeds) beside the paper's where given."""
    import numpy as np

    def as_array(values):
        return np.array([math.nan if value is None else float(value) for value in values], dtype=float)

    ours, paper = as_array(ours), as_array(paper)
    std = as_array(ours_std) if ours_std is not None else np.full(len(ours), math.nan)
    positions = np.arange(len(labels))
    figure = _figure(max(6.0, 0.9 * len(labels) + 2.0), 5.0)
    axes = figure.add_subplot()
    have_paper = ~np.isnan(paper)
    width = 0.4 if have_paper.any() else 0.6
    offset = width / 2 if have_paper.any() else 0.0
    # error bars only where several seeds gave a standard deviation: a cap at zero would suggest one
    error = np.where(np.isnan(std), 0.0, std) if not np.isnan(std).all() else None
    bars = axes.bar(positions - offset, np.nan_to_num(ours), width, yerr=error, capsize=3, color="C0", label="ours")
    axes.bar_label(bars, labels=[f"{value:.1f}" if not math.isnan(value) else "" for value in ours],
                   fontsize=7, padding=2)
    if have_paper.any():
        paper_bars = axes.bar(positions[have_paper] + offset, paper[have_paper], width, color="C1",
                              label="paper (Table 3)")
        axes.bar_label(paper_bars, labels=[f"{value:.1f}" for value in paper[have_paper]], fontsize=7, padding=2)
    highest = np.nanmax(np.concatenate([ours + np.nan_to_num(std), paper, [0.0]]))
    axes.set_ylim(0.0, max(1.0, 1.12 * highest))  # BLEU is never negative; room for the value labels
    axes.set_xticks(positions, labels, rotation=30, ha="right", fontsize=8)
    axes.set_ylabel(ylabel)
    axes.set_title("Table 3: dev BLEU, no checkpoint averaging")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(fontsize=8)
    return _save(figure, path)


def plot_attention(weights, tokens: Sequence[str], path: str | Path, title: str,
                   panel_titles: Sequence[str], highlight_rows: Sequence[int] = (), columns: int | None = None) -> Path:
    """Attention heatmaps (``attention_figure``) as a PNG."""
    return _save(attention_figure(weights, tokens, title, panel_titles, highlight_rows, columns), path)


TITLE_FONTSIZE = 11
ATTENTION_TICK_FONTSIZE = 8  # points: a piece's label is readable at the figure's own size
ATTENTION_PANEL_MAX_INCHES = 16.0  # beyond this a long sentence's labels shrink instead


def wrap_to_width(figure, text: str, fontsize: float, inches: float) -> list[str]:
    """``text``'s lines broken between words so that each fits in ``inches`` at ``fontsize``, as measured
    by the figure's renderer (a title set in one line is clipped at the figure's edges, not wrapped)."""
    from matplotlib.font_manager import FontProperties

    renderer = figure.canvas.get_renderer()
    font = FontProperties(size=fontsize)

    def fits(line: str) -> bool:
        return renderer.get_text_width_height_descent(line, font, ismath=False)[0] / figure.dpi <= inches

    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if line and not fits(candidate):
                lines.append(line)
                candidate = word
            line = candidate
        lines.append(line)
    return lines


def attention_figure(weights, tokens: Sequence[str], title: str, panel_titles: Sequence[str],
                     highlight_rows: Sequence[int] = (), columns: int | None = None):
    """Attention heatmaps, one panel per head: rows attend (queries), columns are attended to (keys).

    weights: (panels, len, len) array with rows summing to 1; tokens label both axes, at
    ``ATTENTION_TICK_FONTSIZE`` unless the sentence is too long for ``ATTENTION_PANEL_MAX_INCHES``. The rows
    in ``highlight_rows`` (the pieces of the word the paper discusses) are outlined together. The colour
    scale runs from 0 to the largest weight of the figure, shared by its panels, so that the diffuse
    attention of a long sentence is still visible and panels stay comparable.
    """
    import numpy as np
    from matplotlib.patches import Rectangle

    weights = np.asarray(weights, dtype=float)
    panels, length = weights.shape[0], weights.shape[-1]
    if columns is None:  # near-square grids: 2 heads side by side, 4 as 2 x 2, 8 as 2 x 4, 16 as 4 x 4
        columns = 4 if panels > 4 else min(panels, 2)
    columns = max(1, min(columns, panels))
    rows = math.ceil(panels / columns)
    # Each panel grows with the sentence so that every piece keeps a label of a readable size.
    inches = min(max(1.25 * ATTENTION_TICK_FONTSIZE / 72 * length, 3.5), ATTENTION_PANEL_MAX_INCHES)
    fontsize = min(ATTENTION_TICK_FONTSIZE, 0.8 * inches * 72 / max(length, 1))
    # Margins are computed from the longest label instead of by a layout engine, which would measure
    # every one of the (heads x 2 x len) tick labels once more before drawing: half the time of a figure.
    axis_title = 0.3  # the line that says which axis attends
    labels = 0.2 + 0.65 * fontsize / 72 * max((len(token) for token in tokens), default=1) + axis_title
    title_space, gap, colourbar = 0.35, 0.3, 1.1
    cell_width, cell_height = labels + inches + gap, title_space + inches + labels + gap
    width = columns * cell_width + colourbar
    figure = _figure(width, 1.0, layout=None)  # its height once the title is wrapped to its width
    title_lines = wrap_to_width(figure, title, TITLE_FONTSIZE, width - 0.4)
    heading = 0.4 + 1.4 * TITLE_FONTSIZE / 72 * len(title_lines)  # a line and a bit per line of title
    height = rows * cell_height + heading
    figure.set_size_inches(width, height)
    top = float(weights.max()) if weights.size and weights.max() > 0 else 1.0
    image = None
    for panel in range(panels):
        row, column = divmod(panel, columns)
        left = column * cell_width + labels
        bottom = height - heading - row * cell_height - title_space - inches
        axes = figure.add_axes((left / width, bottom / height, inches / width, inches / height))
        image = axes.imshow(weights[panel], cmap="viridis", vmin=0.0, vmax=top, interpolation="nearest")
        axes.set_xticks(range(length), tokens, rotation=90, fontsize=fontsize)
        axes.set_yticks(range(length), tokens, fontsize=fontsize)
        axes.tick_params(length=0, pad=1)
        axes.set_xlabel("attending to (keys)", fontsize=9)
        axes.set_ylabel("attending from (queries)", fontsize=9)
        if len(highlight_rows):
            first, last = min(highlight_rows), max(highlight_rows)
            axes.add_patch(Rectangle((-0.5, first - 0.5), length, last - first + 1, fill=False, edgecolor="red",
                                     linewidth=1.0))
        axes.set_title(panel_titles[panel], fontsize=9)
    bar_height = min(inches, height - heading - 0.5)
    bar = figure.add_axes(((width - colourbar + 0.2) / width, (height - heading - title_space - bar_height) / height,
                           0.2 / width, bar_height / height))
    figure.colorbar(image, cax=bar, label="attention weight")
    figure.suptitle("\n".join(title_lines), fontsize=TITLE_FONTSIZE, y=1 - 0.15 / height, va="top")
    return figure
