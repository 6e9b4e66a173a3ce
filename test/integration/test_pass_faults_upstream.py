"""On upstream's own request object: a request of a pass that lost a peer finishes with 503 and
our message at its next result, the way the prefill and decode paths apply it
(``Req.update_finish_state``), and is barred from the radix cache."""

from __future__ import annotations

from array import array

import pytest

pytest.importorskip("sglang")

from sglang_elastic_ep.sglang.pass_faults import (  # noqa: E402
    PEER_FAILED_DURING_FORWARD,
    end_with_503,
)


def make_req(rid: str) -> object:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "hi", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=4))


def test_a_marked_request_finishes_with_503_and_skips_the_cache() -> None:
    running, done = make_req("running"), make_req("done")
    done.finished_reason = object()  # finished on an earlier pass: not touched
    assert end_with_503([running, done]) == 1
    assert running.skip_radix_cache_insert and not done.skip_radix_cache_insert
    running.output_ids.append(7)  # the token of the faulted forward, as the paths append it
    running.update_finish_state()
    assert running.finished()
    reason = running.finished_reason.to_json()
    assert reason["type"] == "abort" and reason["status_code"] == 503
    assert reason["message"] == PEER_FAILED_DURING_FORWARD
