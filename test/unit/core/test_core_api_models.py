import json

import pytest
from pydantic import ValidationError

from sglang_elastic_ep.core.api_models import (
    EVENT_ADAPTER,
    RankFailedEvent,
    RankState,
    ScaleRequest,
    ScaleResponse,
    StatusResponse,
    describe_validation_error,
)
from sglang_elastic_ep.core.phases import Phase


def _error(body: object) -> str:
    with pytest.raises(ValidationError) as info:
        ScaleRequest.model_validate(body)
    return describe_validation_error(info.value).error


@pytest.mark.parametrize(
    "body, target",
    [
        ({"new_ep_size": 3}, 3),
        ({"new_tp_size": 5}, 5),
        ({"new_ep_size": 4, "new_tp_size": 4}, 4),
        ({"new_ep_size": 2, "operation_id": "op-1.a:b_c", "expected_instance_id": "abc"}, 2),
    ],
)
def test_scale_request_accepts_valid_bodies(body: dict, target: int) -> None:
    assert ScaleRequest.model_validate(body).target_ep_size == target


def test_scale_request_from_json_text() -> None:
    req = ScaleRequest.model_validate_json('{"new_tp_size": 8, "operation_id": "x1"}')
    assert (req.target_ep_size, req.operation_id) == (8, "x1")


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"new_ep_size": True}, "must be a JSON integer"),
        ({"new_ep_size": 3.0}, "got 3.0 of type float"),
        ({"new_tp_size": "3"}, "new_tp_size must be a JSON integer"),
        ({"new_ep_size": 0}, "must be at least 1"),
        ({"new_ep_size": -2}, "must be at least 1"),
        ({}, 'send new_ep_size, the target number of EP ranks, e.g. {"new_ep_size": 4}'),
        ({"operation_id": "a"}, "send new_ep_size"),
        ({"new_ep_size": 3, "new_tp_size": 4}, "disagree; send only new_ep_size"),
        ({"new_ep_size": 3, "foo": 1}, "unknown field 'foo'; allowed fields: new_ep_size"),
        ({"new_ep_size": 3, "operation_id": "has space"}, "operation_id must be 1-128"),
        ({"new_ep_size": 3, "operation_id": "x" * 129}, "operation_id must be 1-128"),
        ({"new_ep_size": 3, "operation_id": ""}, "operation_id must be 1-128"),
        ({"new_ep_size": 3, "expected_instance_id": 7}, "expected_instance_id must be"),
        ([3], "must be a JSON object"),
    ],
)
def test_scale_request_rejections_say_what_to_do(body: object, expected: str) -> None:
    message = _error(body)
    assert message.startswith("invalid scale request: ")
    assert expected in message


def test_long_bad_values_are_truncated_in_messages() -> None:
    message = _error({"new_ep_size": 3, "operation_id": "y" * 500})
    assert "y" * 50 not in message and "..." in message


def test_scale_response_round_trips_and_forbids_extras() -> None:
    resp = ScaleResponse(
        message="Scaling initiated from 2 to 3, polling for new ranks",
        accepted=True,
        old_ep_size=2,
        new_ep_size=3,
        phase=Phase.WAITING_FOR_COHORT,
        operation_id="op",
        instance_id="inst",
    )
    data = json.loads(resp.model_dump_json())
    assert data["phase"] == "waiting_for_cohort" and data["replayed"] is False
    assert ScaleResponse.model_validate(data) == resp
    with pytest.raises(ValidationError):
        ScaleResponse.model_validate({**data, "surprise": 1})


def test_event_union_dispatches_on_type() -> None:
    raw = {
        "type": "rank_failed",
        "event_id": 7,
        "time": 1.5,
        "instance_id": "i",
        "ranks": [2],
        "reason": "heartbeat lost",
    }
    event = EVENT_ADAPTER.validate_python(raw)
    assert isinstance(event, RankFailedEvent) and event.ranks == [2]
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python({**raw, "type": "rank_exploded"})
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python({**raw, "event_id": 0})


def test_status_response_serialises_rank_states() -> None:
    status = StatusResponse(
        instance_id="i",
        phase=Phase.IDLE,
        effective_ep_size=2,
        pending_ep_size=None,
        max_ep_size=3,
        ranks=[
            {"rank": 0, "state": "active"},
            {"rank": 1, "state": "failed"},
            {"rank": 2, "state": "inactive"},
        ],
    )
    assert [r.state for r in status.ranks] == [
        RankState.ACTIVE,
        RankState.FAILED,
        RankState.INACTIVE,
    ]
    assert json.loads(status.model_dump_json())["ranks"][1] == {
        "rank": 1, "state": "failed", "experts": None, "expert_slots": None,
    }
