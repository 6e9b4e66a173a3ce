"""A CPU server's child processes fork from their parent instead of spawning.

Upstream starts the data-parallel controller, the schedulers and the detokenizer with
multiprocessing's ``spawn``, since CUDA does not survive a fork. Each spawned child then
imports torch, transformers and SGLang again: on two cores that was most of a server's start-up
(23 of the 43 s of a 2-rank server, docs/cpu-testbed.md, "Fork, not spawn"). No CUDA runs on
this bed, and the parent has touched neither Mooncake nor NIXL when it starts its children
(they are created in the schedulers), so a fork is safe here and the children begin with
everything imported.

``SGLANG_EEP_CHILD_START=spawn`` keeps upstream's spawn: the way a GPU server starts, each
child loading the plugins through their entry points. One e2e scenario runs that way.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

from sglang_elastic_ep_testbed.cpu.settings import env_choice

logger = logging.getLogger(__name__)

ENV_CHILD_START = "SGLANG_EEP_CHILD_START"
CHILD_START_METHODS = ("fork", "spawn")
DEFAULT_CHILD_START = "fork"
CHILD_START_LINE = "this server's child processes start with"


def child_start_method() -> str:
    return env_choice(ENV_CHILD_START, CHILD_START_METHODS, DEFAULT_CHILD_START)


def fork_children(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``engine._set_envs_and_config``, which has just set ``spawn``."""
    method = child_start_method()
    if method != multiprocessing.get_start_method():
        multiprocessing.set_start_method(method, force=True)
    logger.info("%s %s (%s)", CHILD_START_LINE, method, ENV_CHILD_START)
    return result
