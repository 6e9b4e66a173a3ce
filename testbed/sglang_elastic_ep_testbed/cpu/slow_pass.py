"""Every thread's stack in the server's log when a forward pass runs long, on the CPU testbed.

A process that is not scheduled and one whose main thread is blocked in a native call that keeps
the GIL look the same from outside (docs/cpu-testbed.md, "Seen three times: a rank's NIXL
message never arrived"). ``faulthandler``'s watchdog is a native thread that needs no GIL: armed
for each pass, it prints every Python thread's stack once the pass has run
``SGLANG_EEP_SLOW_PASS_DUMP_S`` (default 20 s; 0 turns it off). On time, a dump shows the call
the main thread is blocked in; a process that was not scheduled prints it only once it runs
again, after the log lines stamped later.
"""

from __future__ import annotations

import faulthandler
import functools
import sys
from typing import Any

from sglang_elastic_ep_testbed.cpu.settings import env_number

ENV_SLOW_PASS_DUMP_S = "SGLANG_EEP_SLOW_PASS_DUMP_S"
# A healthy pass on the CPU cluster takes milliseconds; a survivor waits up to its NIXL timeout
# (35-50 s) for a dead peer, so a fault scenario prints one dump per rank that waited.
DEFAULT_SLOW_PASS_DUMP_S = 20.0


@functools.cache  # read once per process: it is asked on every forward pass
def slow_pass_dump_s() -> float:
    return env_number(ENV_SLOW_PASS_DUMP_S, DEFAULT_SLOW_PASS_DUMP_S, low=0, unit=" s")


def dump_stacks_of_a_slow_pass(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ModelRunner.forward``: arm the dump for this pass and disarm it after."""
    after_s = slow_pass_dump_s()
    if after_s == 0:
        return original(runner, *args, **kwargs)
    faulthandler.dump_traceback_later(after_s, repeat=False, file=sys.stderr)
    try:
        return original(runner, *args, **kwargs)
    finally:
        faulthandler.cancel_dump_traceback_later()
