"""The HTML page (html/page.py) and the whole report (html/writer.py), read as text."""

from __future__ import annotations

import base64
import html
import re

from featdiff.diff.result import Comparison, Finding
from featdiff.dump.reader import read_dump
from featdiff.html import write_report
from featdiff.html.page import Picture, render_page, summarise_ints, verdict_sentence

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)]


def test_report_opens_with_the_verdict_and_the_findings(plus1_pair, tmp_path) -> None:
    out = write_report(plus1_pair.ref, plus1_pair.run, tmp_path / "report.html", comparison=plus1_pair.comparison)
    page = out.read_text()
    verdict, findings = page.index("id='verdict'"), page.index("id='findings'")
    assert (
        verdict
        < findings
        < page.index("id='divergence-map'")
        < page.index("id='layer-match'")
        < page.index("id='row-shift'")
        < page.index("id='records'")
        < page.index("id='alignments'")
    )
    assert "FAIL: 1 error finding; the first divergent record is inp_target_features (e1 draft inject)" in page
    (error,) = [f for f in plus1_pair.comparison.findings if f.severity == "error"]  # compare's, rendered as made
    assert error.kind == "layer_offset" and html.escape(error.message) in page
    assert "slot 0 of inp_target_features is the input of target layer 3; the checkpoint expects layer 2" in page
    assert "observed_layer=3" in page


def test_report_is_self_contained_with_every_figure_embedded(plus1_pair, tmp_path) -> None:
    page = write_report(
        plus1_pair.ref, plus1_pair.run, tmp_path / "r.html", comparison=plus1_pair.comparison
    ).read_text()
    images = _images(page)
    assert len(images) == 3 and all(i.startswith(PNG_MAGIC) for i in images)
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert not re.search(r"""(src|href)=['"](?!data:)""", page)  # nothing fetched from elsewhere


def test_png_dir_gets_each_figure(plus1_pair, tmp_path) -> None:
    write_report(
        plus1_pair.ref, plus1_pair.run, tmp_path / "r.html", comparison=plus1_pair.comparison, png_dir=tmp_path / "png"
    )
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert pngs == ["divergence-map.png", "layer-match.png", "row-shift.png"]
    assert all((tmp_path / "png" / p).read_bytes().startswith(PNG_MAGIC) for p in pngs)


def test_clean_report_says_ok_and_why_the_row_shift_is_missing(clean_pair, tmp_path) -> None:
    page = write_report(
        clean_pair.ref, clean_pair.run, tmp_path / "r.html", comparison=clean_pair.comparison, png_dir=tmp_path / "png"
    ).read_text()
    assert "OK: no error finding; no compared record is out of tolerance." in page
    assert "Not drawn: no record diverged" in page
    assert len(_images(page)) == 2 and not (tmp_path / "png" / "row-shift.png").exists()


def test_per_record_table_lists_metrics_tolerance_and_alignment(shift_pair, tmp_path) -> None:
    c = shift_pair.comparison
    page = write_report(shift_pair.ref, shift_pair.run, tmp_path / "r.html", comparison=c).read_text()
    rows = re.findall(r"<tr class='([a-z ]*)'>", page[page.index("id='records'") : page.index("id='alignments'")])
    assert len(rows) == len(c.pairs)
    assert rows[c.first_divergence] == "bad first"
    assert f"{c.pairs[0].tolerance:.3g}" in page
    assert c.alignments[0].run_key in page and c.alignments[0].ref_key in page


def test_findings_text_is_escaped(clean_pair) -> None:
    finding = Finding("divergence", "<b>x</b>", "error", "values of <b>x</b> & y differ", {"metric": "nmse"})
    c = Comparison("ref.npz", "run.npz", (finding,), (), ())
    with read_dump(clean_pair.ref) as ref:
        page = render_page(c, ref.manifest, ref.manifest, [Picture("x", "X", "", missing="test")])
    assert "values of &lt;b&gt;x&lt;/b&gt; &amp; y differ" in page and "<b>x</b>" not in page
    assert verdict_sentence(c) == "FAIL: 1 error finding; no compared record is out of tolerance."


def test_integer_lists_are_summarised_as_ranges() -> None:
    assert summarise_ints([0, 1, 2, 3, 7, 9, 10]) == "0..3, 7, 9..10"
    assert summarise_ints(list(range(0, 60, 2))).endswith("... (30 in all)")


def test_verdict_states_the_coverage_it_rests_on(clean_pair) -> None:
    from featdiff.diff.result import Coverage, Skip

    skip = Skip(
        role="draft",
        phase="draft",
        round=1,
        name="inp_noise_embd",
        occurrence=0,
        reason="token_history",
        side="both",
        whole=True,
        records=1,
        rows=(7, 8, 9, 10),
        evals=(2,),
    )
    c = Comparison(
        "ref.npz", "run.npz", (), (), (), skipped=(skip.line(),), coverage=Coverage(pairs=3, rows=12, skips=(skip,))
    )
    with read_dump(clean_pair.ref) as ref:
        page = render_page(c, ref.manifest, ref.manifest, [])
    assert (
        "Compared 3 record sets (12 rows); 1 record set skipped, 4 rows left out (listed under the records table)."
        in page
    )
    assert html.escape("inp_noise_embd (drafter's draft, round 1, occurrence 0): not compared") in page
    bare = render_page(Comparison("ref.npz", "run.npz", (), (), ()), ref.manifest, ref.manifest, [])
    assert "class='coverage'" not in bare


def test_report_states_the_dumps_facts_from_compares_manifests_without_reading_the_dumps(plus1_pair, tmp_path) -> None:
    import shutil

    from featdiff.diff import compare_dumps

    ref, run = shutil.copy(plus1_pair.ref, tmp_path / "ref.npz"), shutil.copy(plus1_pair.run, tmp_path / "run.npz")
    c = compare_dumps(ref, run)
    assert c.manifests is not None and c.manifests[0].source and c.manifests[1].source
    ref.unlink()  # the report must not open either dump again
    run.unlink()
    page = write_report(ref, run, tmp_path / "r.html", comparison=c).read_text()
    assert f"({html.escape(c.manifests[0].source)})" in page and f"({html.escape(c.manifests[1].source)})" in page
    assert f"<tr><th>records</th><td>{len(c.manifests[1].records)}</td></tr>" in page
