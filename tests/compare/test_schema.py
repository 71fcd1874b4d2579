"""docs/findings.schema.json: the findings JSON's schema follows the code's vocabulary, and what
compare writes follows the schema (tests/conftest.py validates every findings JSON the suite
makes; these tests pin the validator and the vocabulary)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.phases import Phase
from featdiff.diff import compare_dumps
from featdiff.diff.fields import (
    RECORD_OF,
    RECORDS,
    BlockTokenFields,
    Fields,
    PositionOffsetFields,
    UnpairedFields,
    fields_of,
)
from featdiff.diff.result import KINDS, SCHEMA_VERSION, SKIP_REASONS, Finding, Kind
from featdiff.diff.schema import finding_properties

import synth
from findings_schema import SCHEMA_PATH, errors, load_schema, validate_findings, written


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


# --- the schema's finding properties are made from the field records (diff/fields.py) ---------


def test_schema_finding_properties_are_those_the_field_records_make():
    """docs/findings.schema.json's finding properties are exactly what diff/schema.py makes of
    `Finding`, the flow keys and every kind's record: a field added to a record and not to the
    schema (or the other way round) fails here."""
    made = finding_properties()
    written_down = load_schema()["$defs"]["finding"]["properties"]
    assert made == written_down, {
        k: (made.get(k), written_down.get(k))
        for k in set(made) | set(written_down)
        if made.get(k) != written_down.get(k)
    }


def test_every_kind_has_one_field_record():
    assert [r.KIND for r in RECORDS] == list(KINDS)
    assert set(RECORD_OF) == set(KINDS)


@dataclass(frozen=True)
class _RowsAsText(Fields):
    KIND: ClassVar[Kind] = "zeros"
    rows: str  # `rows` is ints in every other kind


def test_a_key_typed_two_ways_is_refused():
    with pytest.raises(ValueError, match="`rows` is .* a key means one thing"):
        finding_properties((*RECORDS, _RowsAsText))


def _kinds_table() -> dict[str, str]:
    """docs/findings.md's Kinds table: kind -> its fields cell."""
    text = (SCHEMA_PATH.parent / "findings.md").read_text()
    table = text[text.index("## Kinds") :].split("\n\n")[1]
    out = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for kind in re.findall(r"`(\w+)`", cells[0]):
            out[kind] = cells[-1]
    return out


def test_the_kinds_table_names_every_field_of_each_kinds_record():
    table = _kinds_table()
    assert set(table) == set(KINDS)
    missing = {
        r.KIND: [f.name for f in dataclass_fields(r) if f"`{f.name}`" not in table[r.KIND]]
        for r in RECORDS
        if any(f"`{f.name}`" not in table[r.KIND] for f in dataclass_fields(r))
    }
    assert not missing, f"docs/findings.md's Kinds table lacks these fields: {missing}"


def test_a_record_writes_its_fields_as_before_and_reads_them_back():
    """Tuples are written as lists, an ABSENT member is left out (not null), None is kept (null),
    and the record reads back from the JSON, flow keys and all."""
    of_record = PositionOffsetFields(offset=2)
    of_batch = PositionOffsetFields(offset=1, role="draft", phase=Phase.INJECT, round=0, eval=1)
    assert of_record.to_json() == {"offset": 2}
    assert of_batch.to_json() == {"offset": 1, "role": "draft", "phase": "inject", "round": 0, "eval": 1}
    block = BlockTokenFields(row=3, expected=9, observed=None, round=1, eval=2)
    assert block.to_json()["observed"] is None
    for record in (of_record, of_batch, block, UnpairedFields("missing_eval", 1, (7, 8), (3,), 2, side="run")):
        finding = Finding.of(record, tensor="t", message="m")
        assert finding.kind == record.KIND and finding.fields == record.to_json()
        read = Finding.from_json(written({"f": {**finding.to_json(), "flow": 1, "seq_id": 0}})["f"])
        assert fields_of(read) == record
