"""E2E tests start real SGLang servers on CPU; all of them carry the ``e2e`` marker.

Two markers keep a scenario out of the default suite (README command 2, CI), with the reason
printed as a skip: ``long`` (a scenario too long for the suite's 30 minutes on 2 cores; run with
``SGLANG_EEP_E2E_LONG=1``, or ``bash scripts/test.sh --long``), ``known_hang(reason)`` (a
scenario that can hang for a known, not yet fixed reason; run with
``SGLANG_EEP_E2E_KNOWN_HANGS=1``) and ``known_race(reason)`` (a scenario that can fail by a
known, not yet fixed race; run with ``SGLANG_EEP_E2E_KNOWN_RACES=1``).

Every scenario that runs is rerun once on a failure (pytest-rerunfailures' ``flaky``): on this
bed Mooncake's CPU transport has races the plugin cannot close (docs/cpu-testbed.md: a survivor
whose collective never completes after a peer died, a replacement that dies in its start-up),
and a cluster scenario runs for minutes. A scenario fails only when both runs fail. Nothing is
hidden: the first run's failure digest stays in ``.cluster/failure-digest.txt``, and
``scripts/test.sh`` prints it, with pytest's ``RERUN`` lines, even when the rerun passed.

``scripts/test.sh`` (the suite) sets ``SGLANG_EEP_SERVER_START=fork`` unless it is set: servers
start as forks of a process that has imported SGLang once (docs/cpu-testbed.md, "Servers
forked from a pre-imported process"), about 5 minutes less for the suite. Without it (pytest
by hand, or ``SGLANG_EEP_SERVER_START=exec``) they are exec'd, as users start them. The
foundation scenario execs its servers either way.
"""

from __future__ import annotations

import os

import pytest

ENV_LONG = "SGLANG_EEP_E2E_LONG"
ENV_KNOWN_HANGS = "SGLANG_EEP_E2E_KNOWN_HANGS"
ENV_KNOWN_RACES = "SGLANG_EEP_E2E_KNOWN_RACES"
SCENARIO_RERUNS = 1


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: an e2e scenario outside the default suite")
    config.addinivalue_line("markers", "known_hang(reason): an e2e scenario with a known hang")
    config.addinivalue_line("markers", "known_race(reason): an e2e scenario with a known race")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_long = os.environ.get(ENV_LONG) == "1"
    run_hangs = os.environ.get(ENV_KNOWN_HANGS) == "1"
    run_races = os.environ.get(ENV_KNOWN_RACES) == "1"
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            if not item.get_closest_marker("flaky"):
                item.add_marker(pytest.mark.flaky(reruns=SCENARIO_RERUNS))
        if item.get_closest_marker("long") and not run_long:
            item.add_marker(pytest.mark.skip(
                reason=f"long scenario, outside the 30-minute suite: run with {ENV_LONG}=1"))
        hang = item.get_closest_marker("known_hang")
        if hang and not run_hangs:
            item.add_marker(pytest.mark.skip(
                reason=f"known hang: {hang.args[0]}; run with {ENV_KNOWN_HANGS}=1"))
        race = item.get_closest_marker("known_race")
        if race and not run_races:
            item.add_marker(pytest.mark.skip(
                reason=f"known race: {race.args[0]}; run with {ENV_KNOWN_RACES}=1"))
