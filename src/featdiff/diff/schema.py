"""The findings schema's finding properties (docs/findings.schema.json, `$defs.finding`), made from
the records that define them: `Finding`'s own members, the flow members of a run of several flows,
and every kind's field record (diff/fields.py). A key means one thing in every kind that has
it: two records that type one key differently are an error here, not two schemas.

The type of a member says its schema (`int` an integer, `tuple[int, ...]` the schema's `ints`,
`Role` / `Phase` / `Kind` / `SkipReason` their `$defs`, a `Literal` its values, a union its
members, `None` null; `Absent`, a key some producers of a kind leave out, nothing); `KEY_NOTES`
adds what a type cannot say (a bound, a description). tests/compare/test_schema.py checks that
docs/findings.schema.json holds exactly these properties.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Any, Literal

from featdiff.core.names import Role
from featdiff.core.phases import Phase
from featdiff.diff.fields import RECORDS, Absent, FlowFields, WhereFields
from featdiff.diff.result import Finding, Kind, SkipReason

# Types the schema names in its `$defs`.
NAMED: tuple[tuple[Any, str], ...] = ((Role, "role"), (Kind, "kind"), (SkipReason, "skip_reason"))
SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
# What a member's type cannot say, by key: merged into the schema the type gives.
KEY_NOTES: dict[str, dict[str, Any]] = {
    "records": {"minimum": 0},
    "sources": {"description": "new (misplaced_rows): the reference positions the misplaced rows hold, one per row"},
    "value": {"description": "nmse: a number; shape: the run's shape; margin: the reference's logit margin"},
    "tolerance": {"description": "nmse: the tolerance; shape: the reference's shape; margin: the noise bound on it"},
    "position": {"description": "new: the position of the row a token was chosen on (near_tie, divergence by margin)"},
    "margin": {
        "description": "new (near_tie): the reference's logit of its argmax minus its logit of the run's token, on that row"
    },
    "bound": {"description": "new (near_tie): the noise bound on that margin, from the record's tolerance"},
    "first_use": {"description": "new (unmodelled): `record (phase)` where the graph first reads each feature"},
    "not_judged": {"description": "new (unmodelled): the record sets set aside, `name (batch)`"},
    "diverged": {"description": "new (unmodelled): the set-aside record sets beyond tolerance"},
    "layer": {"description": "new (expert_choice): the target layer `il` whose MoE routed differently"},
    "margins": {
        "description": "new (expert_choice): the reference's router margin (k-th minus (k+1)-th router logit) on each of `rows`"
    },
    "bounds": {"description": "new (expert_choice): the noise bound on each of those margins"},
    "factors": {
        "description": "new (scale per channel): the factor of each channel (one head's when they repeat per head)"
    },
    "pairs": {"description": "new (divergence, detail rope): the RoPE frequency pairs whose angles differ"},
    "flow": {"description": "new: the flow (request) a finding of a run of several flows is about (docs/flow.md)"},
    "seq_id": {"description": "new: the llama.cpp sequence that served that flow"},
    "where": {"description": "new (every error finding): where the fault lives, by the evidence (docs/findings.md)"},
    "where_reason": {"description": "new (with `where`): the evidence that places it there, or what would decide it"},
    "ids_from": {
        "description": "new (wrong_source another_output_row): per named row, the position whose top-k token ids it read"
    },
}


def type_schema(tp: Any) -> dict[str, Any]:
    """The JSON schema of a member of type `tp` (ABSENT, a left-out key, has none)."""
    for named, ref in NAMED:
        if tp == named:
            return {"$ref": f"#/$defs/{ref}"}
    if tp is Phase:
        return {"$ref": "#/$defs/phase"}
    if tp in SIMPLE:
        return {"type": SIMPLE[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and args[1:] == (Ellipsis,):
        return {"$ref": "#/$defs/ints"} if args[0] is int else {"type": "array", "items": type_schema(args[0])}
    if origin is Literal:
        return {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return _union_schema([a for a in args if a is not Absent])
    raise TypeError(f"diff/schema.py: no JSON schema for the member type {tp!r}; add one to type_schema")


def _union_schema(members: list[Any]) -> dict[str, Any]:
    """Members that are plain JSON types as one `type` list (a tuple as `array`), else `oneOf`."""
    if len(members) == 1:
        return type_schema(members[0])
    plain = [SIMPLE.get(m) or ("array" if typing.get_origin(m) is tuple else None) for m in members]
    if all(plain):
        return {"type": plain}
    return {"oneOf": [type_schema(m) for m in members]}


def _member_types(record: type) -> dict[str, Any]:
    hints = typing.get_type_hints(record)
    return {f.name: hints[f.name] for f in fields(record)}


def finding_properties(records: tuple[type, ...] = RECORDS) -> dict[str, Any]:
    """`$defs.finding.properties` of docs/findings.schema.json: a finding's own keys, the flow and where keys,
    then every kind's fields (`records`); ValueError when two records give one key two schemas."""
    core = {k: v for k, v in _member_types(Finding).items() if k != "fields"}
    out: dict[str, Any] = {k: type_schema(tp) for k, tp in core.items()}
    owner = dict.fromkeys(out, "Finding")
    for record in (FlowFields, WhereFields, *records):
        for key, tp in _member_types(record).items():
            schema = type_schema(tp) | KEY_NOTES.get(key, {})
            if key in out and out[key] != schema:
                raise ValueError(
                    f"diff/fields.py: `{key}` is {out[key]} in {owner[key]} but {schema} in {record.__name__}; "
                    "a key means one thing in every kind: give it one type"
                )
            out.setdefault(key, schema)
            owner.setdefault(key, record.__name__)
    return out
