"""Plot: one heatmap figure, planned as plain data (what each cell shows, every label, every mark).

heatmap.py fills a `Plot` from compare's records; raster.py turns it into PNG pixels. Tests read
the plan without parsing images. Lengths are inches on the figure (pixels = inches * DPI), boxes
measured from its bottom-left corner as matplotlib does; marks sit in cell coordinates (column,
row), cell (j, i) centred on (j, i), row 0 at the top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

DPI = 100
LABEL_PT = 7.5
NOT_COMPARED = "#dcdcdc"
MARK = "#ff2d2d"

Box = tuple[float, float, float, float]  # (left, bottom, width, height), inches from the bottom-left


@dataclass(frozen=True)
class Scale:
    """How a cell's value becomes a colour: a matplotlib colormap over [lo, hi], log or linear."""

    cmap: str  # a matplotlib colormap name, e.g. "magma"
    lo: float
    hi: float
    is_log: bool
    bad: str = NOT_COMPARED  # NaN cells: not compared


@dataclass(frozen=True)
class Tick:
    """A labelled tick at cell `index` of an axis."""

    index: int
    label: str


@dataclass(frozen=True)
class CellText:
    """A text centred on cell (x, y)."""

    x: float
    y: float
    text: str
    size: float  # points
    colour: str


@dataclass(frozen=True)
class MarginLabel:
    """A text right of the axes, centred on row `y` (an eval's name beside its rows)."""

    y: float
    text: str


@dataclass(frozen=True, eq=False)
class Plot:
    """One heatmap figure: cells, axes, colour bar, title and marks, ready to rasterise."""

    size: tuple[float, float]  # (width, height) of the figure, inches
    axes: Box  # where the cells go
    values: np.ndarray  # (n_rows, n_cols) what each cell shows; NaN = not compared
    scale: Scale
    title: str  # may hold "\n"
    colorbar: Box  # a horizontal colour bar
    colorbar_label: str
    xticks: tuple[Tick, ...]
    yticks: tuple[Tick, ...]
    xlabel: str
    ylabel: str
    tick_pt: float = LABEL_PT
    xtick_rotation: Literal[0, 90] = 0
    title_pad: float = 6 / 72  # inches between the axes' top and the title's last line
    margin_labels: tuple[MarginLabel, ...] = ()
    rules: tuple[float, ...] = ()  # white horizontal rules at these row coordinates (between evals)
    boxes: tuple[Box, ...] = ()  # red outlines (x, y, width, height) in cells: (-0.5, -0.5, 1, 1) rings cell (0, 0)
    box_px: int = 2  # outline width, pixels
    circles: tuple[tuple[float, float], ...] = ()  # red rings at cells (x, y)
    stars: tuple[tuple[float, float], ...] = ()  # white stars at cells (x, y), drawn at the cell's top right
    cell_texts: tuple[CellText, ...] = ()
    dashed: tuple[tuple[float, float], ...] = ()  # a white dashed polyline through cells (x, y)
    note: str = ""  # red bold text just above the axes (the first divergence)
