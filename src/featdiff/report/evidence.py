"""Evidence: the figure data that needs arrays, read from the two dumps through compare.

Consumes two open dumps (dump.py) and a `Comparison`; asks compare for what it measured the
same way (`layer_match_matrix`, `load_pair`) and returns the figure data of figure.py, or None
when the dumps lack what a figure needs (the page then says what is missing).
"""

from __future__ import annotations

from pathlib import Path

from featdiff.compare import layer_match_matrix, load_pair
from featdiff.compare.evidence import target_layers
from featdiff.compare.result import Comparison
from featdiff.dump import Dump
from featdiff.report.figure import LayerMatch, RowShift, eval_label, first_bad_position, measure_row_shift


def layer_match_from_dumps(ref: Dump, run: Dump, name_map: Path | None = None) -> LayerMatch | None:
    """Slots of the run's first injected features x the ref's `layer_inp-<L>` (compare's
    layer-match sketch), with the layers each manifest names."""
    match = layer_match_matrix(ref, run, name_map)
    if match is None:
        return None
    return LayerMatch(matrix=match.similarity, layers=match.layers, expected=match.expected_layers,
                      run_layers=target_layers(run.manifest), n_rows=len(match.positions))


def row_shift_from_dumps(ref: Dump, run: Dump, comparison: Comparison) -> RowShift | None:
    """Run rows x ref rows of the first divergent pair, as compare aligned them (by position);
    None without a divergence or when compare could not align its two sides."""
    index = comparison.first_divergence
    if index is None or index >= len(comparison.alignments) or not comparison.alignments[index].comparable:
        return None
    pair, alignment = comparison.pairs[index], comparison.alignments[index]
    ref_rows, run_rows = load_pair(ref, run, alignment)  # (R, D) each, row i at the same position
    if not len(ref_rows) or not len(run_rows):
        return None
    positions = alignment.positions or tuple(range(len(run_rows)))
    return measure_row_shift(run_rows, ref_rows, positions, alignment.positions or tuple(range(len(ref_rows))),
                             f"{pair.name} ({eval_label(pair)})", focus=first_bad_position(pair))
