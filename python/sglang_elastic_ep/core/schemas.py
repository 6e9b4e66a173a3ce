"""Write the JSON Schemas of the HTTP contract: ``python -m sglang_elastic_ep.core.schemas DIR``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sglang_elastic_ep.core.api_models import (
    EVENT_ADAPTER,
    CancelResponse,
    ErrorResponse,
    HealthResponse,
    ScaleRequest,
    ScaleResponse,
    StatusResponse,
)

_MODELS: dict[str, type[BaseModel]] = {
    "scale_request": ScaleRequest,
    "scale_response": ScaleResponse,
    "cancel_response": CancelResponse,
    "error_response": ErrorResponse,
    "status_response": StatusResponse,
    "health_response": HealthResponse,
}


def all_schemas() -> dict[str, dict[str, Any]]:
    """File stem -> JSON Schema, for every request, response and event body."""
    schemas: dict[str, dict[str, Any]] = {
        name: model.model_json_schema() for name, model in _MODELS.items()
    }
    event_schema = EVENT_ADAPTER.json_schema()
    event_schema["title"] = "Event"
    event_schema["description"] = (
        "One event of GET /elastic_ep/events (SSE data: field), discriminated by 'type'."
    )
    schemas["event"] = event_schema
    return schemas


def write_schemas(out_dir: str | Path) -> list[Path]:
    """Write ``<stem>.json`` for each schema into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, schema in all_schemas().items():
        path = out / f"{name}.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m sglang_elastic_ep.core.schemas OUT_DIR", file=sys.stderr)
        return 2
    for path in write_schemas(args[0]):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
