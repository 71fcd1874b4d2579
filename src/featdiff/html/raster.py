"""Raster: a planned `Plot` (plot.py) drawn as PNG bytes with Pillow.

Consumes a `Plot`; produces PNG bytes. The cells are one lookup in the matplotlib colormap's own
256-entry table, indexed by numpy for every pixel at once (no per-cell drawing), so a cell has the
colour matplotlib's imshow gave it; text is DejaVu Sans, the font matplotlib ships and drew with.
A matplotlib figure cost the report about 0.8 s per figure, mostly tick and text layout
(docs/measurements.md); this costs a few tens of milliseconds.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.colors import to_rgb
from PIL import Image, ImageDraw, ImageFont

from featdiff.html.plot import DPI, LABEL_PT, MARK, Box, Plot, Scale

LUT_SIZE = 256  # entries of matplotlib's colormaps: a cell's colour is entry int(t * 256)
# zlib level of the PNG stream: flat cells compress about as well at 1 as at 6 (142 kB vs 111 kB for
# the bench's divergence map), in a third of the time
PNG_ZLIB_LEVEL = 1
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FONT_DIR = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
TICK_PT = 3.5  # tick length, as matplotlib's default
PAD_PT = 3.5  # between a tick and its label
EXPONENT_SCALE = 0.75  # a decade's exponent, raised, at this fraction of the label size (as mathtext)
PixelBox = tuple[int, int, int, int]  # (x0, y0, x1, y1), pixels from the top-left


def png_from_plot(plot: Plot) -> bytes:
    """The plot as PNG bytes, `plot.size * DPI` pixels."""
    canvas = _Canvas(plot)
    canvas.cells()
    canvas.marks()
    canvas.ticks()
    canvas.titles()
    canvas.colorbar()
    return png_from_pixels(np.asarray(canvas.image))


def png_from_pixels(pixels: np.ndarray) -> bytes:
    """(height, width, 3) uint8 as a PNG (ISO 15948): 8-bit RGB, filter type 0 on every row, one
    IDAT. Pillow's encoder tries a filter per row, which costs five times the deflate itself."""
    height, width, _ = pixels.shape
    filters = np.zeros((height, 1), np.uint8)  # (height, 1): filter type 0, each row as it is
    rows = np.concatenate([filters, pixels.reshape(height, width * 3)], axis=1)  # (height, 1 + 3 * width)
    # depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(rows.tobytes(), PNG_ZLIB_LEVEL)
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _chunk(kind: bytes, data: bytes) -> bytes:
    """A PNG chunk: length, type, data, and the CRC-32 of type and data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def cell_colours(values: np.ndarray, scale: Scale) -> np.ndarray:
    """(n_rows, n_cols, 3) uint8: each cell's colour on `scale`, its `bad` colour where NaN."""
    lut = np.vstack([_lut(scale.cmap), np.asarray(to_rgb(scale.bad)) * 255]).astype(np.uint8)  # (LUT_SIZE + 1, 3)
    index = np.minimum((_normalised(values, scale) * LUT_SIZE).astype(np.int64), LUT_SIZE - 1)
    index[np.isnan(values)] = LUT_SIZE
    return lut[index]  # (n_rows, n_cols, 3)


def _lut(cmap: str) -> np.ndarray:
    return matplotlib.colormaps[cmap](np.linspace(0.0, 1.0, LUT_SIZE))[:, :3] * 255  # (LUT_SIZE, 3)


def _normalised(values: np.ndarray, scale: Scale) -> np.ndarray:
    """Values mapped onto [0, 1] of the scale, clipped at both ends (NaN read as the floor)."""
    v = np.clip(np.nan_to_num(np.asarray(values, dtype=np.float64), nan=scale.lo), scale.lo, scale.hi)
    if scale.is_log:
        return (np.log10(v) - math.log10(scale.lo)) / (math.log10(scale.hi) - math.log10(scale.lo))
    return (v - scale.lo) / (scale.hi - scale.lo)


def _px(points: float) -> float:
    return points * DPI / 72


class _Canvas:
    """One figure's image, its axes box in pixels and the fonts it has opened."""

    def __init__(self, plot: Plot) -> None:
        self.plot = plot
        self.image = Image.new("RGB", (round(plot.size[0] * DPI), round(plot.size[1] * DPI)), "white")
        self.draw = ImageDraw.Draw(self.image)
        self.fonts: dict[tuple[float, bool], ImageFont.FreeTypeFont] = {}
        self.ax = self.box(plot.axes)

    def box(self, box: Box) -> PixelBox:
        left, bottom, width, height = box
        top = self.image.height - (bottom + height) * DPI
        return round(left * DPI), round(top), round((left + width) * DPI), round(top + height * DPI)

    def at(self, x: float, y: float) -> tuple[float, float]:
        """The pixel at cell coordinates (x, y): cell (j, i) spans j - 0.5 .. j + 0.5."""
        x0, y0, x1, y1 = self.ax
        n_rows, n_cols = self.plot.values.shape
        return x0 + (x + 0.5) * (x1 - x0) / n_cols, y0 + (y + 0.5) * (y1 - y0) / n_rows

    def font(self, points: float, bold: bool = False) -> ImageFont.FreeTypeFont:
        if (points, bold) not in self.fonts:
            name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
            self.fonts[points, bold] = ImageFont.truetype(str(FONT_DIR / name), size=_px(points))
        return self.fonts[points, bold]

    # --- cells and marks ---

    def cells(self) -> None:
        """Every pixel of the axes takes its cell's colour (nearest cell, as imshow's "nearest")."""
        x0, y0, x1, y1 = self.ax
        colours = cell_colours(self.plot.values, self.plot.scale)  # (n_rows, n_cols, 3)
        rows = _pixel_cells(y1 - y0, colours.shape[0])  # (height,) row of each pixel row
        cols = _pixel_cells(x1 - x0, colours.shape[1])  # (width,) column of each pixel column
        self.image.paste(Image.fromarray(np.ascontiguousarray(colours[rows][:, cols]), "RGB"), (x0, y0))
        self.draw.rectangle((x0 - 1, y0 - 1, x1, y1), outline="black", width=1)

    def marks(self) -> None:
        p = self.plot
        x0, _, x1, _ = self.ax
        for r in p.rules:
            y = self.at(0, r)[1]
            self.draw.line((x0, y, x1 - 1, y), fill="white", width=2)
        self._dashed(p.dashed)
        for c, r, w, h in p.boxes:
            (bx0, by0), (bx1, by1) = self.at(c, r), self.at(c + w, r + h)  # cell edges sit at j - 0.5
            self.draw.rectangle((bx0, by0, bx1 - 1, by1 - 1), outline=MARK, width=p.box_px)
        ring = _px(9) / 2
        for x, y in p.circles:
            cx, cy = self.at(x, y)
            self.draw.ellipse((cx - ring, cy - ring, cx + ring, cy + ring), outline=MARK, width=2)
        for x, y in p.stars:  # at the cell's top right, clear of its number
            self.draw.polygon(_star(*self.at(x + 0.3, y - 0.25), _px(13) / 2), fill="white", outline="black")
        for t in p.cell_texts:
            self.draw.text(self.at(t.x, t.y), t.text, font=self.font(t.size), fill=t.colour, anchor="mm")

    def _dashed(self, points: tuple[tuple[float, float], ...]) -> None:
        """A white dashed line through `points` (cells): 3 pixels on, 4 off."""
        for (xa, ya), (xb, yb) in zip(points, points[1:]):
            (pa, qa), (pb, qb) = self.at(xa, ya), self.at(xb, yb)
            length = math.hypot(pb - pa, qb - qa)
            for s in np.arange(0.0, length, 7.0):
                e = min(s + 3.0, length)
                f, g = s / max(length, 1e-9), e / max(length, 1e-9)
                self.draw.line(
                    (pa + f * (pb - pa), qa + f * (qb - qa), pa + g * (pb - pa), qa + g * (qb - qa)), "white"
                )

    # --- ticks, labels, titles ---

    def ticks(self) -> None:
        p = self.plot
        x0, y0, x1, y1 = self.ax
        tick, pad, font = _px(TICK_PT), _px(PAD_PT), self.font(p.tick_pt)
        below = 0.0  # the deepest x tick label, pixels below the axes
        for t in p.xticks:
            x = self.at(t.index, 0)[0]
            self.draw.line((x, y1, x, y1 + tick), fill="black")
            below = max(below, self.text((x, y1 + tick + pad), t.label, font, "ma", rotate=p.xtick_rotation))
        widest = 0.0  # the widest y tick label
        for t in p.yticks:
            y = self.at(0, t.index)[1]
            self.draw.line((x0 - tick, y, x0 - 1, y), fill="black")
            widest = max(widest, self.text((x0 - tick - pad, y), t.label, font, "rm"))
        label = self.font(p.tick_pt + 1)
        if p.xlabel:
            self.text(((x0 + x1) / 2, y1 + tick + pad + below + pad), p.xlabel, label, "ma")
        if p.ylabel:
            self.text((x0 - tick - 2 * pad - widest, (y0 + y1) / 2), p.ylabel, label, "rm", rotate=90)
        for m in p.margin_labels:
            self.text((x1 + 0.01 * (x1 - x0), self.at(0, m.y)[1]), m.text, font, "lm")

    def titles(self) -> None:
        p = self.plot
        x0, y0 = self.ax[0], self.ax[1]
        font = self.font(10.0)
        y = y0 - _px(p.title_pad * 72)
        for line in reversed(p.title.split("\n")):
            self.draw.text((x0, y), line, font=font, fill="black", anchor="ld")
            y -= font.size * 1.2
        if p.note:
            note = self.font(LABEL_PT + 1.5, bold=True)
            self.draw.text((x0, y0 - _px(6)), p.note, font=note, fill=MARK, anchor="ld")

    def text(
        self, xy: tuple[float, float], text: str, font: ImageFont.FreeTypeFont, anchor: str, rotate: int = 0
    ) -> float:
        """Draw `text` (lines apart, "m" anchors centre the block); its extent across the anchor's
        axis in pixels: the width of a right-anchored label, the depth of a top-anchored one."""
        if rotate:
            return self._rotated(xy, text, font, anchor)
        lines = text.split("\n")
        step = font.size * 1.2
        x, y = xy
        if anchor[1] == "m":
            y -= step * (len(lines) - 1) / 2
        for i, line in enumerate(lines):
            self.draw.text((x, y + i * step), line, font=font, fill="black", anchor=anchor)
        if anchor[0] in "lr":
            return max(font.getlength(line) for line in lines)
        return step * len(lines)

    def _rotated(self, xy: tuple[float, float], text: str, font: ImageFont.FreeTypeFont, anchor: str) -> float:
        """`text` turned 90 degrees counter-clockwise: "ma" hangs it below xy, "rm" ends it left of xy."""
        left, top, right, bottom = font.getbbox(text)
        mask = Image.new("L", (max(1, math.ceil(right - left)), max(1, math.ceil(bottom - top))))
        ImageDraw.Draw(mask).text((-left, -top), text, font=font, fill=255)
        mask = mask.transpose(Image.Transpose.ROTATE_90)  # (text width tall, text height wide)
        w, h = mask.size
        x, y = xy
        corner = (round(x - w / 2), round(y)) if anchor == "ma" else (round(x - w), round(y - h / 2))
        self.image.paste("black", (*corner, corner[0] + w, corner[1] + h), mask)
        return float(h if anchor == "ma" else w)

    # --- colour bar ---

    def colorbar(self) -> None:
        p = self.plot
        x0, y0, x1, y1 = self.box(p.colorbar)
        t = (np.arange(x1 - x0) + 0.5) / (x1 - x0)  # (width,) position along the bar, 0..1
        value = (
            p.scale.lo * (p.scale.hi / p.scale.lo) ** t
            if p.scale.is_log
            else p.scale.lo + t * (p.scale.hi - p.scale.lo)
        )
        row = cell_colours(value[None, :], p.scale)  # (1, width, 3)
        self.image.paste(Image.fromarray(np.ascontiguousarray(np.repeat(row, y1 - y0, axis=0)), "RGB"), (x0, y0))
        self.draw.rectangle((x0 - 1, y0 - 1, x1, y1), outline="black", width=1)
        font, tick, pad = self.font(LABEL_PT), _px(TICK_PT), _px(PAD_PT)
        small = self.font(LABEL_PT * EXPONENT_SCALE)
        for at, label, exponent in _colorbar_ticks(p.scale):
            x = x0 + at * (x1 - x0)
            self.draw.line((x, y1, x, y1 + tick), fill="black")
            left = x - (font.getlength(label) + small.getlength(exponent)) / 2  # the pair centred on its tick
            drop = 0.35 * font.size if exponent else 0.0  # room above the base for its exponent
            self.draw.text((left, y1 + tick + pad + drop), label, font=font, fill="black", anchor="la")
            self.draw.text(
                (left + font.getlength(label), y1 + tick + pad), exponent, font=small, fill="black", anchor="la"
            )
        label_y = y1 + tick + 2 * pad + font.size * (1.55 if p.scale.is_log else 1.2)
        self.draw.text(
            ((x0 + x1) / 2, label_y), p.colorbar_label, font=self.font(LABEL_PT + 0.5), fill="black", anchor="ma"
        )


def _pixel_cells(n_pixels: int, n_cells: int) -> np.ndarray:
    """(n_pixels,) the cell under each pixel's centre."""
    return np.minimum(((np.arange(n_pixels) + 0.5) * n_cells / max(n_pixels, 1)).astype(np.int64), n_cells - 1)


def _colorbar_ticks(scale: Scale) -> list[tuple[float, str, str]]:
    """(fraction along the bar, label, its exponent): each decade on a log scale ("10", "-6"),
    fifths on a linear one (no exponent)."""
    if scale.is_log:
        decades = range(math.ceil(math.log10(scale.lo)), math.floor(math.log10(scale.hi)) + 1)
        span = math.log10(scale.hi) - math.log10(scale.lo)
        return [((d - math.log10(scale.lo)) / span, "10", str(d).replace("-", "\u2212")) for d in decades]
    return [(i / 5, f"{scale.lo + i / 5 * (scale.hi - scale.lo):.1f}", "") for i in range(6)]


def _star(x: float, y: float, radius: float) -> list[tuple[float, float]]:
    """A five-pointed star's corners around (x, y), a point up."""
    corners = []
    for i in range(10):
        r = radius if i % 2 == 0 else radius * 0.4
        a = math.pi / 2 + i * math.pi / 5
        corners.append((x + r * math.cos(a), y - r * math.sin(a)))
    return corners
