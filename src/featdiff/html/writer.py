"""Writer: the report from two dumps and their comparison, as one HTML file (and PNGs).

Consumes the ref and run dump paths and the `Comparison` compare made of them (with the two
manifests compare read, for the page's facts: the dumps are not read again); draws what compare
concluded (heatmap.py, raster.py) and writes the page (page.py). Never runs a model and measures
nothing: every figure is compare's data.
"""

from __future__ import annotations

import logging
from pathlib import Path

from featdiff.core.outputs import check_output, check_output_dir, replaced
from featdiff.diff.result import Comparison
from featdiff.diff.rowshift import RowShift
from featdiff.diff.sketch import LayerMatch
from featdiff.dump.manifest import Manifest
from featdiff.dump.reader import read_dump
from featdiff.html.figure import DivergenceMap, bin_map, map_divergence
from featdiff.html.heatmap import MAX_MAP_COLS, MAX_MAP_ROWS, draw_divergence_map, draw_layer_match, draw_row_shift
from featdiff.html.page import Picture, render_page
from featdiff.html.raster import png_from_plot

log = logging.getLogger(__name__)


def write_report(
    ref: Path,
    run: Path,
    output: Path,
    *,
    comparison: Comparison,
    png_dir: Path | None = None,
    name_map: Path | None = None,
    output_flag: str = "-o",
) -> Path:
    """Write the self-contained HTML report to `output` (and each figure to `png_dir`).

    `name_map` is the one compare used (`--map`): an input, never overwritten. Neither output may
    be an input (`output_flag` is the option that named `output`, for the message).
    """
    inputs = (Path(ref), Path(run), name_map)
    output = check_output(Path(output), inputs, output_flag)
    if png_dir is not None:
        png_dir = check_output_dir(Path(png_dir), inputs, "--png-dir")
    pictures = draw_pictures(comparison)
    ref_manifest, run_manifest = comparison.manifests or _manifests(ref, run)
    page = render_page(comparison, ref_manifest, run_manifest, pictures)
    with replaced(output) as tmp:
        tmp.write_text(page, encoding="utf-8")
    if png_dir is not None:
        write_pngs(pictures, png_dir)
    return output


def _manifests(ref: Path, run: Path) -> tuple[Manifest, Manifest]:
    """The two manifests, read again: only for a comparison that does not carry them (made by hand)."""
    with read_dump(ref) as ref_dump, read_dump(run) as run_dump:
        return ref_dump.manifest, run_dump.manifest


def draw_pictures(comparison: Comparison) -> tuple[Picture, ...]:
    """The three figures of the page, in order: divergence map, layer match, row shift."""
    return (
        _divergence_picture(bin_map(map_divergence(comparison, MAX_MAP_COLS), MAX_MAP_ROWS, MAX_MAP_COLS)),
        _layer_match_picture(comparison.layer_match),
        _row_shift_picture(comparison.row_shift),
    )


def write_pngs(pictures: tuple[Picture, ...], png_dir: Path) -> tuple[Path, ...]:
    """Each drawn picture as `<png_dir>/<slug>.png`."""
    png_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for p in pictures:
        if p.png is not None:
            path = png_dir / f"{p.slug}.png"
            with replaced(path) as tmp:
                tmp.write_bytes(p.png)
            paths.append(path)
    log.info("wrote %d figures to %s", len(paths), png_dir)
    return tuple(paths)


def _divergence_picture(m: DivergenceMap) -> Picture:
    title = "Divergence map"
    if m.matrix.size == 0:
        return Picture("divergence-map", title, "", missing="compare measured no record pairs.")
    first = (
        "The red box is the first divergent record, the circle its first token row over tolerance. "
        if m.first_row is not None
        else "No record diverged. "
    )
    caption = (
        f"{first}Rows are records in graph order, one eval (a phase of the flow) between white "
        f"rules; columns are token positions; colour is each row's relative error on a log scale "
        f"from 1e-6 (black) to 10 (bright); grey cells were not compared."
    )
    return Picture("divergence-map", title, caption, png_from_plot(draw_divergence_map(m)))


def _layer_match_picture(m: LayerMatch | None) -> Picture:
    title = "Layer match: feature slots x target layer inputs"
    if m is None:
        return Picture(
            "layer-match",
            title,
            "",
            missing=(
                "needs inp_target_features in the run dump and layer_inp-<L> records of a target eval "
                "with the same positions in the ref dump (the reference writes them)."
            ),
        )
    run_says = f"; the run's manifest says {list(m.run_layers)}" if m.run_layers else ""
    caption = (
        f"Each row is a slot of the run's inp_target_features, each column the input of a target "
        f"layer in the reference; colour is the relative error rms(slot - layer input) / rms(layer "
        f"input) over {len(m.positions)} token rows, on a log scale (on compare's random-projection "
        f"sketch of the rows, as its layer_offset detector sees them). The error, not the cosine: "
        f"neighbouring layer inputs can have a cosine near 1, while only the layer a slot holds matches "
        f"it to rounding, decades below its neighbours. The checkpoint expects target_layers "
        f"{list(m.expected_layers)} (red boxes){run_says}; the closest match per slot (white stars) "
        f"is {list(m.closest_layers)}."
    )
    return Picture("layer-match", title, caption, png_from_plot(draw_layer_match(m)))


def _row_shift_picture(m: RowShift | None) -> Picture:
    title = "Row-shift matrix of the first divergent record"
    if m is None:
        return Picture(
            "row-shift",
            title,
            "",
            missing=("no record diverged, or compare could not align the two sides of the first divergent one."),
        )
    shift = m.best_shift()
    verdict = "its rows line up with the reference" if shift == 0 else f"run row i looks most like ref row i + {shift}"
    window = (
        f" (run rows at positions {m.run_positions[0]}..{m.run_positions[-1]} of {m.n_run_rows}, "
        f"around its first row over tolerance)"
        if m.n_run_rows > len(m.run_positions)
        else ""
    )
    caption = (
        f"Cosine similarity of every run row of {m.record} with every ref row{window}, as compare "
        f"aligned them; the dashed line marks rows at the same position. By the brightest cell of "
        f"each run row, {verdict}."
    )
    return Picture("row-shift", title, caption, png_from_plot(draw_row_shift(m)))
