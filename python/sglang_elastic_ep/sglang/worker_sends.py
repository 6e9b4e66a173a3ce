"""The DP controller must not block forever on a worker whose scheduler died.

SGLang's DP controller sends requests and control messages to each DP worker over a ZMQ PUSH
socket. For the slots of ranks added by scale-up the primary *binds* that socket and the
joiner connects to it. When the joiner dies, the socket has no peer left, and ZMQ blocks a
PUSH send with no peer until one appears: the controller's only thread stops, and with it every
request to every shard. Seen: after a joiner was killed, a health poll (a control message to
all live-looking workers) sent before the controller learnt of the death stopped all serving.

Sends to a worker socket are made non-blocking; one with no peer is dropped with a warning.
Nothing is lost silently: a generate request dropped this way was routed to that shard by the
tokenizer, which ends it with 503 once the shard is reported down (tokenizer_hooks); a control
request's caller stops waiting at its timeout. (SGLang sets no send high-water mark on these
sockets, so a live but slow worker never refuses a message.)
"""

from __future__ import annotations

from typing import Any

import zmq

from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled

logger = get_logger(__name__)


def send_to_worker(original: Any, socket: Any, obj: Any, flags: int = 0) -> None:
    """AROUND ``data_parallel_controller.sock_send`` (the controller's own binding of it)."""
    if not elastic_ep_enabled() or socket.socket_type != zmq.PUSH:
        return original(socket, obj, flags)
    try:
        return original(socket, obj, flags | zmq.NOBLOCK)
    except zmq.Again:
        logger.warning(
            "elastic EP: DP worker socket %s has no peer (its scheduler died?): dropped %s",
            socket.getsockopt_string(zmq.LAST_ENDPOINT) or "?", type(obj).__name__,
        )
        return None
