import json
from pathlib import Path

from sglang_elastic_ep.core.schemas import all_schemas, main, write_schemas

DOCS_API = Path(__file__).resolve().parents[3] / "docs" / "api"


def test_write_schemas_creates_one_file_per_body(tmp_path: Path) -> None:
    written = write_schemas(tmp_path)
    names = sorted(p.name for p in written)
    assert names == [
        "cancel_response.json",
        "error_response.json",
        "event.json",
        "health_response.json",
        "scale_request.json",
        "scale_response.json",
        "status_response.json",
    ]
    request = json.loads((tmp_path / "scale_request.json").read_text())
    assert request["additionalProperties"] is False
    assert {"new_ep_size", "new_tp_size", "operation_id"} <= set(request["properties"])
    event = json.loads((tmp_path / "event.json").read_text())
    assert event["discriminator"]["propertyName"] == "type"
    assert {"safe_to_terminate", "scale_cancelled"} <= set(event["discriminator"]["mapping"])


def test_committed_docs_match_the_models() -> None:
    # Regenerate with: python -m sglang_elastic_ep.core.schemas docs/api
    for name, schema in all_schemas().items():
        committed = json.loads((DOCS_API / f"{name}.json").read_text())
        assert committed == schema, f"docs/api/{name}.json is stale"


def test_cli_usage_and_success(tmp_path: Path, capsys) -> None:
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err
    assert main([str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "event.json").exists()
