"""The report stage: reads compare's `Comparison` (and the two dumps' manifests); writes one
self-contained HTML page (heatmaps as embedded PNGs) and, on request, the PNGs themselves. Never
runs a model and measures nothing: the figures are compare's result, drawn.

figure.py lays out the divergence map from compare's per-row errors (pure); heatmap.py plans it
and compare's `LayerMatch` and `RowShift` as `Plot`s (plot.py, pure); raster.py draws a plan as
PNG bytes; page.py writes the HTML; writer.py ties them together.
"""

from featdiff.html.figure import DivergenceMap, bin_map, map_divergence
from featdiff.html.page import Picture, render_page
from featdiff.html.writer import draw_pictures, write_pngs, write_report

__all__ = [
    "DivergenceMap",
    "Picture",
    "bin_map",
    "draw_pictures",
    "map_divergence",
    "render_page",
    "write_pngs",
    "write_report",
]
