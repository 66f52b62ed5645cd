"""The JSON Schema of ``--json-schema`` in ``engine bench one-batch`` and ``engine bench serving``."""

from __future__ import annotations

import json

#: The schema ``--json-schema ''`` benchmarks: nested objects, an array, enums, bounded strings.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 32},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "owner": {"type": "object", "properties": {"email": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["email", "age"]},
    },
    "required": ["id", "name", "status", "tags", "owner"],
}


def load_bench_schema(path: str | None) -> str | None:
    """``--json-schema``: None (unconstrained), '' (``BENCH_SCHEMA``) or a JSON Schema file."""
    if path is None:
        return None
    if path == "":
        return json.dumps(BENCH_SCHEMA)
    with open(path, encoding="utf-8") as f:
        return json.dumps(json.load(f))
