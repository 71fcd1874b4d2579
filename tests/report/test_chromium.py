"""The report as a browser shows it: headless Chromium renders it from disk, with no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff.html import write_report

from chromium_probe import assert_renders, probe

pytestmark = pytest.mark.browser


def test_report_renders_with_findings_and_every_figure_decoded(plus1_pair, tmp_path: Path) -> None:
    page = write_report(plus1_pair.ref, plus1_pair.run, tmp_path / "report.html", comparison=plus1_pair.comparison)
    assert_renders(page, [f.message for f in plus1_pair.comparison.findings], 3, tmp_path)


def test_probe_notices_an_image_that_does_not_decode(plus1_pair, tmp_path: Path) -> None:
    page = write_report(plus1_pair.ref, plus1_pair.run, tmp_path / "report.html", comparison=plus1_pair.comparison)
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("base64,iVBORw0KGgo", "base64,AAAAAAAAAA", 1))
    body = probe(broken, tmp_path)
    assert body["images"] == "3" and body["decoded"] == "2"
