"""Random JSON schemas from a seed, each bounding its answer's length (integers in a range, enums,
strings with maxLength, arrays with maxItems, objects with a fixed set of properties), so a model
with random weights can finish every one within a few hundred tokens."""

from __future__ import annotations

import random
from typing import Any


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema: 1-4 properties (some required), no others allowed."""
    names = rng.sample(
        ["id", "name", "tags", "count", "ok", "kind", "items", "meta", "level", "note"], rng.randint(1, 4)
    )
    props = {n: _value(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "string", "enum", "boolean", "array"] + (["object"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 8)}
    if kind == "enum":
        pool = ["red", "green", "blue", "yes", "no", 1, 2, 3, None, True]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = _value(rng, depth + 1) if depth < 3 else {"type": "integer", "minimum": 0, "maximum": 9}
        return {"type": "array", "items": item, "maxItems": rng.randint(0, 3)}
    return random_schema(rng, depth)


def random_schemas(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]
