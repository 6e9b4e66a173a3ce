"""A cluster finds the processes that escaped its servers' trees by its own environment tag."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from sglang_elastic_ep_testbed.cluster.procs import kill_tree, processes_tagged, wait_gone

TAG = "SGLANG_EEP_TEST_TAG"


def _sleeper(env_tag: str | None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if env_tag is not None:
        env[TAG] = env_tag
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)


def test_only_the_processes_carrying_the_tag_are_found() -> None:
    tag = uuid.uuid4().hex
    mine, other, untagged = _sleeper(tag), _sleeper(uuid.uuid4().hex), _sleeper(None)
    try:
        found = {p.pid for p in processes_tagged(TAG, tag)}
        assert found == {mine.pid}
        kill_tree(mine.pid, hard=True)
        mine.wait(timeout=10)
        assert processes_tagged(TAG, tag) == []
    finally:
        for proc in (mine, other, untagged):
            kill_tree(proc.pid, hard=True)
            proc.wait(timeout=10)
            assert wait_gone(proc.pid, 10)
