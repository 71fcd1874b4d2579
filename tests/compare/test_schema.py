"""docs/findings.schema.json: the findings JSON's schema follows the code's vocabulary, and what
compare writes follows the schema (tests/conftest.py validates every findings JSON the suite
makes; these tests pin the validator and the vocabulary)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.compare import compare_dumps
from featdiff.compare.result import KINDS, SCHEMA_VERSION, SKIP_REASONS

import synth
from findings_schema import errors, load_schema, validate_findings, written


def test_schema_names_every_kind_and_skip_reason_of_the_code():
    schema = load_schema()
    assert schema["$defs"]["kind"]["enum"] == list(KINDS)
    assert schema["$defs"]["skip_reason"]["enum"] == list(SKIP_REASONS)
    assert schema["properties"]["schema_version"]["const"] == SCHEMA_VERSION


def test_json_written_by_the_cli_validates(synth_ref, synth_run):
    run = synth_run(spec=synth.Spec(target_layers=(3, 5)), models={"draft": {"target_layers": [2, 4]}})
    result = CliRunner().invoke(app, ["compare", str(synth_ref), str(run), "--json", "-"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    validate_findings(data)
    assert data["first_divergence"]["name"] == "inp_target_features"


def test_clean_comparison_has_no_first_divergence(synth_ref, synth_run):
    data = written(compare_dumps(synth_ref, synth_run(), None).to_json())
    assert data["ok"] and data["first_divergence"] is None and data["types"]["kv_type"] == "f16"


@pytest.mark.parametrize(
    "break_it, complaint",
    [
        (lambda d: d.pop("coverage"), "missing 'coverage'"),
        (
            lambda d: d["findings"].append({"kind": "bogus", "tensor": "x", "severity": "error", "message": "m"}),
            "bogus",
        ),
        (lambda d: d["records"][0].update(nmse="high"), "$.records[0].nmse"),
        (lambda d: d["records"][0].update(new_key=1), "unexpected key 'new_key'"),
    ],
)
def test_validator_rejects_what_breaks_the_schema(synth_ref, synth_run, break_it, complaint):
    data = written(compare_dumps(synth_ref, synth_run(), None).to_json())
    break_it(data)
    assert any(complaint in e for e in errors(data, load_schema()))
