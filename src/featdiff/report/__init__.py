"""The report stage: reads two dumps and compare's findings; writes one self-contained HTML page
(heatmaps as embedded PNGs) and, on request, the PNGs themselves. Never runs a model.

figure.py holds the figure data (pure); evidence.py fills its array-backed parts through compare's
readers (layer_match_matrix, load_pair); heatmap.py draws it; page.py writes the HTML; writer.py
ties them together.
"""

from featdiff.report.figure import (DivergenceMap, LayerMatch, RowShift, bin_map,
                                    map_divergence, measure_row_shift)
from featdiff.report.evidence import layer_match_from_dumps, row_shift_from_dumps
from featdiff.report.page import Picture, render_page
from featdiff.report.writer import draw_pictures, write_pngs, write_report

__all__ = [
    "DivergenceMap", "LayerMatch", "RowShift", "Picture", "bin_map", "draw_pictures",
    "layer_match_from_dumps", "map_divergence", "measure_row_shift",
    "render_page", "row_shift_from_dumps", "write_pngs", "write_report",
]
