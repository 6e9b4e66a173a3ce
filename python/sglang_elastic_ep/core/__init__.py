"""Pure core of elastic EP: the decisions, none of the side effects.

"Pure" means these modules import only the standard library and pydantic: no sglang, no torch,
no torch.distributed, no sockets, no threads started. They hold the HTTP contract
(``api_models``), the operation registry, request validation, the per-role state machines,
the rank agreement protocol (over an abstract key-value store), the expert placement planner,
rank health accounting and the autoscaling policy. Adapters in the rest of the package feed
them observations (forward-pass counters, peer states, store access, clocks) and carry out the
actions they return. Everything here is unit-tested in milliseconds without a GPU.
"""
