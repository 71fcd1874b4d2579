"""What a person and a script get: the rich summary, the findings JSON (round-trips through
Finding.from_json), and the exit codes through the CLI."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console
from typer.testing import CliRunner

import featdiff.diff
from featdiff.cli import app
from featdiff.diff import compare_dumps, exit_code, render_summary, verdict, write_json
from featdiff.diff.render import MESSAGE_HEADINGS
from featdiff.diff.result import Coverage, Finding

import synth

REF_MODELS = {"draft": {"target_layers": [2, 4]}, "target": {"n_embd": 16}}
TERMINAL_COLUMNS = 80  # the narrowest terminal the summary is held to


def faulty(synth_run):
    return synth_run(spec=synth.Spec(target_layers=(3, 5)), models=REF_MODELS)


def test_findings_json_round_trips(synth_ref, synth_run, tmp_path):
    c = compare_dumps(synth_ref, faulty(synth_run), None)
    out = tmp_path / "f.json"
    write_json(c, str(out))
    data = json.loads(out.read_text())
    assert {"ok", "findings", "records", "coverage"} <= set(data) and data["ok"] is False  # keys only added
    assert data["schema_version"] == 1 and data["versions"]["featdiff"] == featdiff.__version__
    first = data["first_divergence"]
    assert (first["record"], first["name"]) == (c.first_divergence, "inp_target_features")
    assert data["records"][first["record"]]["name"] == "inp_target_features" and first["tolerance"] > 0
    assert all(r["tolerance_sources"] for r in data["records"] if r["tolerance"] > 0)
    assert tuple(Finding.from_json(f) for f in data["findings"]) == c.findings
    assert len(data["records"]) == len(c.pairs)
    assert Coverage.from_json(data["coverage"]) == c.coverage
    assert data["coverage"]["pairs"] == len(c.pairs) and data["coverage"]["skipped"] == []


def test_json_has_no_nan_even_for_nonfinite_data(synth_ref, synth_run, tmp_path):
    def poison(ev, name, a):
        return np.full_like(a, np.nan) if name == "inp_g_embeddings" else a

    c = compare_dumps(synth_ref, synth_run(mutate=poison), None)
    out = tmp_path / "f.json"
    write_json(c, str(out))
    json.loads(out.read_text(), parse_constant=lambda s: (_ for _ in ()).throw(ValueError(s)))


def test_summary_leads_with_the_verdict_and_the_fix(synth_ref, synth_run):
    c = compare_dumps(synth_ref, faulty(synth_run), None)
    buf = io.StringIO()
    render_summary(c, verbose=False, console=Console(file=buf, width=200))
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith(
        "FAIL: 1 error finding; first divergence: inp_target_features (drafter's inject, eval 1)"
    )
    assert "slot 0 of inp_target_features is the input of target layer 3" in buf.getvalue()
    assert "DIVERGES" not in buf.getvalue()  # the per-record table only with verbose


def test_verbose_summary_lists_every_record(synth_ref, synth_run):
    c = compare_dumps(synth_ref, faulty(synth_run), None)
    buf = io.StringIO()
    render_summary(c, verbose=True, console=Console(file=buf, width=200))
    text = buf.getvalue()
    assert "DIVERGES" in text and "inherited" in text and text.count("l_out-3") >= 3


def test_verdict_ok_states_what_was_compared_and_skipped(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(), None)
    rows = sum(len(a.positions) for a in c.alignments)
    assert verdict(c) == f"OK: no error finding over {len(c.pairs)} compared records ({rows} rows); 0 skipped"
    assert exit_code(c) == 0 and c.coverage.pairs == len(c.pairs) and c.coverage.rows == rows


def test_verbose_summary_lists_what_was_not_compared(synth_ref, tmp_path):
    run = synth.write(tmp_path / "run.npz", side="run", spec=synth.Spec(rounds=3))
    c = compare_dumps(synth_ref, run, None)
    assert verdict(c).endswith("; 11 record sets skipped, 44 rows left out")
    buf = io.StringIO()
    render_summary(c, verbose=True, console=Console(file=buf, width=300))
    assert "not compared: inp_noise_embd (drafter's draft, round 3, occurrence 0)" in buf.getvalue()


def test_cli_exit_codes_and_json_on_stdout(synth_ref, synth_run, tmp_path):
    runner = CliRunner()
    clean = runner.invoke(app, ["compare", str(synth_ref), str(synth_run())])
    assert clean.exit_code == 0 and clean.output.startswith("OK")
    bad = runner.invoke(app, ["compare", str(synth_ref), str(faulty(synth_run)), "--json", "-"])
    assert bad.exit_code == 1
    assert json.loads(bad.stdout)["findings"][0]["kind"] == "layer_offset"
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"not a zip")
    unusable = runner.invoke(app, ["compare", str(synth_ref), str(broken)])
    assert unusable.exit_code == 2 and "broken.npz" in unusable.output


def test_cli_map_option_reads_a_name_map(synth_ref, synth_run, tmp_path):
    bad_map = tmp_path / "bad.toml"
    bad_map.write_text("[names\n")
    result = CliRunner().invoke(app, ["compare", str(synth_ref), str(synth_run()), "--map", str(bad_map)])
    assert result.exit_code == 2 and "bad.toml" in result.output


def test_json_never_overwrites_the_name_map_it_was_compared_with(synth_ref, synth_run, tmp_path):
    name_map = tmp_path / "fork.toml"
    name_map.write_bytes((Path(featdiff.diff.__file__).parent / "maps" / "dspark.toml").read_bytes())
    before = name_map.read_bytes()
    result = CliRunner().invoke(
        app, ["compare", str(synth_ref), str(synth_run()), "--map", str(name_map), "--json", str(name_map)]
    )
    assert result.exit_code == 2, result.output
    assert f"{name_map}: --json must not be an input of this command" in result.output
    assert name_map.read_bytes() == before and not list(tmp_path.glob("*.partial"))


def test_the_verdict_names_the_first_divergence_in_words(synth_ref, synth_run):
    c = compare_dumps(synth_ref, faulty(synth_run), None)
    assert verdict(c).startswith("FAIL: 1 error finding; first divergence: inp_target_features (drafter's inject, ")
    assert "(draft " not in verdict(c) and "1 error findings" not in verdict(c)


def _summary(c, width: int) -> str:
    buf = io.StringIO()
    render_summary(c, console=Console(file=buf, width=width))
    return buf.getvalue()


def test_findings_table_fits_80_columns_with_a_heading_per_severity(synth_ref, synth_run):
    c = compare_dumps(synth_ref, faulty(synth_run), None)
    note = Finding(
        "flow_note", "-", "info", "eval 5: " + "the drafter decoded a token batch while a draft waited; " * 4
    )
    c = replace(c, findings=(*c.findings, note))
    text = _summary(c, TERMINAL_COLUMNS)
    lines = text.splitlines()
    # the verdict is one line for scripts (the terminal wraps it); the table's lines are folded
    assert lines[0].startswith("FAIL: ") and max(map(len, lines[1:])) <= TERMINAL_COLUMNS, text
    headings = [next(i for i, line in enumerate(lines) if h in line) for h in MESSAGE_HEADINGS.values()]
    error_row = next(i for i, line in enumerate(lines) if line.startswith("error"))
    info_row = next(i for i, line in enumerate(lines) if line.startswith("info"))
    assert headings[0] < error_row < headings[1] < info_row  # "what to do" over errors, "note" over info rows
    assert sum("what to do" in line for line in lines) == 1


def test_compare_on_an_80_column_terminal_prints_no_wider_line(synth_ref, synth_run):
    run = faulty(synth_run)
    result = CliRunner().invoke(app, ["compare", str(synth_ref), str(run)], env={"COLUMNS": str(TERMINAL_COLUMNS)})
    verdict_line, *table = result.output.splitlines()
    assert result.exit_code == 1 and verdict_line.startswith("FAIL: ") and "what to do" in result.output
    assert max(map(len, table)) <= TERMINAL_COLUMNS, result.output
