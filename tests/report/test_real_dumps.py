"""The report on real dumps: the fixture models captured through llama.cpp, the PyTorch
reference, and compare's Comparison of the two (the off-by-one demo: variant layers-plus1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.html import write_report

from chromium_probe import assert_renders

EXIT_FINDINGS = 1


def test_layer_match_of_the_off_by_one_demo_is_the_expected_layer_plus_one(real_pair) -> None:
    m = real_pair("layers-plus1").comparison.layer_match  # compare's, as the report draws it
    assert m is not None
    assert m.expected_layers == (2, 4) and m.run_layers == (3, 5)  # checkpoint ids + 1, and the GGUF's
    assert m.closest_layers == tuple(L + 1 for L in m.expected_layers)
    for k, j in enumerate(m.expected_columns()):
        assert j is not None and m.similarity[k, j] < m.similarity[k].max()  # outlined cell is not the brightest


def test_layer_match_figure_separates_the_match_from_its_neighbours(real_pair) -> None:
    """The figure draws the relative error on a log scale: the layer a slot holds is decades below
    every other layer, where the cosine of its neighbours can be near 1 too."""
    m = real_pair("layers-plus1").comparison.layer_match
    assert m is not None
    for k, best in enumerate(m.closest_layers):
        others = np.delete(m.rel_err[k], m.layers.index(best))  # (n_layers - 1,)
        assert m.closest_error(k) * 100 < others.min(), (k, m.rel_err[k])


@pytest.mark.browser
def test_off_by_one_report_renders_in_chromium(real_pair, tmp_path: Path) -> None:
    pair = real_pair("layers-plus1")
    page = write_report(
        pair.ref, pair.run, tmp_path / "report.html", comparison=pair.comparison, png_dir=tmp_path / "png"
    )
    n_figures = len(list((tmp_path / "png").glob("*.png")))
    assert n_figures == 3
    errors = [f.message for f in pair.comparison.findings if f.severity == "error"]
    assert errors and any("inp_target_features" in m for m in errors)
    assert_renders(page, [f.message for f in pair.comparison.findings], n_figures, tmp_path)


def test_cli_report_writes_the_page_and_the_pngs(real_pair, tmp_path: Path) -> None:
    pair = real_pair("layers-plus1")
    out, png = tmp_path / "report.html", tmp_path / "png"
    result = CliRunner().invoke(app, ["report", str(pair.ref), str(pair.run), "-o", str(out), "--png-dir", str(png)])
    assert result.exit_code == EXIT_FINDINGS, result.output
    assert str(out) in result.output and "FAIL" in out.read_text()
    assert sorted(p.name for p in png.iterdir()) == ["divergence-map.png", "layer-match.png", "row-shift.png"]


def test_cli_compare_also_writes_the_report(real_pair, tmp_path: Path) -> None:
    pair = real_pair("layers-plus1")
    out = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["compare", str(pair.ref), str(pair.run), "--report", str(out)])
    assert result.exit_code == EXIT_FINDINGS, result.output
    assert "layer_offset" in out.read_text()
