"""Validate a findings JSON against docs/findings.schema.json with the subset of JSON Schema
(2020-12) the schema uses; `jsonschema` is not a dependency. An unknown keyword in the schema is
an error here, so the schema cannot silently ask for more than is checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "docs" / "findings.schema.json"
ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description"}
CHECKED = {
    "$ref",
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "oneOf",
    "minimum",
}
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def errors(value: Any, schema: dict[str, Any], root: dict[str, Any] | None = None, at: str = "$") -> list[str]:
    """Every place `value` breaks `schema` (JSONPath-like locations); [] when it conforms."""
    root = root if root is not None else schema
    unknown = set(schema) - ANNOTATIONS - CHECKED
    if unknown:
        raise ValueError(f"{SCHEMA_PATH}: keywords {sorted(unknown)} at {at} are not checked by {__file__}")
    if "$ref" in schema:
        return errors(value, _resolve(root, schema["$ref"]), root, at)
    found: list[str] = []
    kinds = schema.get("type")
    if kinds is not None and not any(TYPES[k](value) for k in ([kinds] if isinstance(kinds, str) else kinds)):
        return [f"{at}: {value!r:.80} is not of type {kinds}"]
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{at}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        found.append(f"{at}: {value!r} is not {schema['const']!r}")
    if "minimum" in schema and TYPES["number"](value) and value < schema["minimum"]:
        found.append(f"{at}: {value} < {schema['minimum']}")
    if "oneOf" in schema:
        passing = [s for s in schema["oneOf"] if not errors(value, s, root, at)]
        if len(passing) != 1:
            found.append(f"{at}: {value!r:.80} matches {len(passing)} of the oneOf alternatives, not exactly 1")
    if isinstance(value, dict):
        found += _object_errors(value, schema, root, at)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += errors(item, schema["items"], root, f"{at}[{i}]")
    return found


def _object_errors(value: dict, schema: dict[str, Any], root: dict[str, Any], at: str) -> list[str]:
    found = [f"{at}: missing {k!r}" for k in schema.get("required", ()) if k not in value]
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in props:
            found += errors(item, props[key], root, f"{at}.{key}")
        elif extra is False:
            found.append(f"{at}: unexpected key {key!r} (add it to the schema: keys are only ever added)")
        elif isinstance(extra, dict):
            found += errors(item, extra, root, f"{at}.{key}")
    return found


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"{SCHEMA_PATH}: only local $refs are checked, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def validate_findings(document: Any) -> None:
    """Raise AssertionError naming every place a findings JSON (as parsed) breaks the schema."""
    schema = load_schema()
    problems = errors(document, schema)
    assert not problems, "findings JSON does not follow docs/findings.schema.json:\n" + "\n".join(problems[:20])


def written(comparison_json: dict[str, Any]) -> Any:
    """`Comparison.to_json()` as `featdiff compare --json` writes it, parsed back (strict JSON)."""
    from featdiff.diff.render import jsonable

    return json.loads(json.dumps(jsonable(comparison_json), allow_nan=False))
