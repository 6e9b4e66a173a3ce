"""The HTTP contract between elastic EP and orchestrators, as pydantic models.

Times are Unix seconds (float). Sizes count EP ranks (one rank per GPU).
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sglang_elastic_ep.core.phases import Phase

# Ids travel in URLs, logs and store keys: keep them to a safe, printable charset.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$"
ID_MAX_LENGTH = 128

SCALE_REQUEST_FIELDS = ("new_ep_size", "new_tp_size", "remove_ranks", "operation_id",
                        "expected_instance_id")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _short_repr(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _require_json_integer(field: str, value: Any) -> Any:
    # bool is an int subclass and 3.0 would coerce: both are almost always client bugs.
    if value is None or (type(value) is int):
        return value
    raise PydanticCustomError(
        "int_type",
        f"{field} must be a JSON integer such as 4 (got {_short_repr(value)} of type "
        f"{type(value).__name__}); send the absolute target number of EP ranks",
    )


def _check_id(field: str, value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, str) or not re.fullmatch(ID_PATTERN, value):
        raise PydanticCustomError(
            "id_format",
            f"{field} must be 1-128 characters of letters, digits and . _ : - "
            f"starting with a letter or digit (got {_short_repr(value)}); a UUID works",
        )
    return value


class ScaleRequest(_Strict):
    """Body of ``POST /scale_elastic_ep``: scale to an absolute number of EP ranks, or remove
    the named ranks (``remove_ranks``)."""

    new_ep_size: int | None = Field(
        default=None, ge=1, description="Target number of EP ranks (absolute, not a delta)."
    )
    new_tp_size: int | None = Field(
        default=None, ge=1, description="Alias of new_ep_size used by the upstream RFC."
    )
    remove_ranks: list[int] | None = Field(
        default=None,
        description="The ranks to remove (the RFC's rank-explicit form), instead of a size. "
        "The highest ranks of the current size are the tail (e.g. [2, 3] of 4 ranks, the same "
        "as new_ep_size 2). Any other set is removed where it is: launch-time ranks anywhere, "
        "ranks that joined by scale-up below a live rank that stays; failed ones at once, live "
        "ones after their shards drain. Their slots become holes, refilled by relaunching them "
        "with --elastic-ep-join-mode recover.",
    )
    operation_id: str | None = Field(
        default=None,
        max_length=ID_MAX_LENGTH,
        pattern=ID_PATTERN,
        description="Client-chosen id; retrying with the same id and target is safe.",
    )
    expected_instance_id: str | None = Field(
        default=None,
        max_length=ID_MAX_LENGTH,
        pattern=ID_PATTERN,
        description="Reject with 412 unless the server has this instance_id (guards restarts).",
    )

    @field_validator("new_ep_size", "new_tp_size", mode="before")
    @classmethod
    def _strict_int(cls, value: Any, info: Any) -> Any:
        value = _require_json_integer(info.field_name, value)
        if value is not None and value < 1:
            raise PydanticCustomError(
                "greater_than_equal",
                f"{info.field_name} must be at least 1 (got {value}); "
                "to stop serving, shut the server down instead",
            )
        return value

    @field_validator("remove_ranks", mode="before")
    @classmethod
    def _rank_list(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, list) or not value:
            raise PydanticCustomError(
                "invalid_ranks", "remove_ranks must be a non-empty list of EP ranks, e.g. [3]")
        if any(type(r) is not int for r in value):
            raise PydanticCustomError(
                "invalid_ranks", f"remove_ranks must hold JSON integers (EP ranks), got "
                f"{_short_repr(value)}")
        ranks = list(value)
        if any(r < 0 for r in ranks):
            raise PydanticCustomError(
                "invalid_ranks", f"remove_ranks holds a negative rank: {ranks}")
        if len(set(ranks)) != len(ranks):
            raise PydanticCustomError(
                "invalid_ranks", f"remove_ranks names a rank twice: {ranks}; name each once")
        return sorted(ranks)

    @field_validator("operation_id", "expected_instance_id", mode="before")
    @classmethod
    def _id_format(cls, value: Any, info: Any) -> Any:
        return _check_id(info.field_name, value)

    @model_validator(mode="after")
    def _one_target(self) -> ScaleRequest:
        sized = self.new_ep_size is not None or self.new_tp_size is not None
        if self.remove_ranks is not None:
            if sized:
                raise PydanticCustomError(
                    "conflicting_target",
                    "send either remove_ranks or new_ep_size, not both",
                )
            return self
        if not sized:
            raise PydanticCustomError(
                "missing_target",
                'send new_ep_size, the target number of EP ranks, e.g. {"new_ep_size": 4}, '
                'or remove_ranks, e.g. {"remove_ranks": [3]}',
            )
        if (
            self.new_ep_size is not None
            and self.new_tp_size is not None
            and self.new_ep_size != self.new_tp_size
        ):
            raise PydanticCustomError(
                "conflicting_target",
                f"new_ep_size ({self.new_ep_size}) and new_tp_size ({self.new_tp_size}) "
                "disagree; send only new_ep_size",
            )
        return self

    @property
    def target_ep_size(self) -> int:
        """The size asked for (a ``remove_ranks`` request is first turned into one with
        ``as_size``, against the size it removes from)."""
        target = self.new_ep_size if self.new_ep_size is not None else self.new_tp_size
        if target is None:
            raise ValueError("a remove_ranks request has no size until resolved (as_size)")
        return target

    def as_size(self, target: int) -> ScaleRequest:
        """The same request naming the size it leaves instead of the ranks it removes."""
        return self.model_copy(update={"new_ep_size": target, "new_tp_size": None,
                                       "remove_ranks": None})


class RejectionReason(str, enum.Enum):
    """Machine-readable cause of a refused scale request, for orchestrators to branch on."""

    INVALID_TARGET = "invalid_target"
    EXCEEDS_MAX_EP_SIZE = "exceeds_max_ep_size"
    INCOMPLETE_ATTENTION_REPLICA = "incomplete_attention_replica"
    INCOMPLETE_NODE = "incomplete_node"
    TOO_FEW_EXPERT_SLOTS = "too_few_expert_slots"
    FAILED_RANKS_PRESENT = "failed_ranks_present"
    MUST_REMOVE_FAILED_RANKS = "must_remove_failed_ranks"
    REMOVED_RANKS_PRESENT = "removed_ranks_present"
    UNKNOWN_RANKS = "unknown_ranks"
    RANK_ZERO = "rank_zero"
    NOT_THE_TAIL = "not_the_tail"
    OPERATION_IN_PROGRESS = "operation_in_progress"
    OPERATION_ID_REUSED = "operation_id_reused"
    INSTANCE_MISMATCH = "instance_mismatch"


class ScaleResponse(_Strict):
    """Answer to a scale request, accepted or not (the HTTP status tells which)."""

    message: str = Field(description="What happened and, when refused, what to do.")
    accepted: bool
    old_ep_size: int
    new_ep_size: int
    phase: Phase
    operation_id: str | None
    instance_id: str
    replayed: bool = Field(
        default=False, description="True when this repeats the answer to an earlier request."
    )
    reason: RejectionReason | None = None


class CancelResponse(_Strict):
    """Answer to ``DELETE /scale_elastic_ep/{operation_id}`` (the HTTP status tells which:
    200 cancelled, 202 still being called off, 404 unknown, 409 past its commit point)."""

    message: str = Field(description="What happened and, when refused, what to do.")
    cancelled: bool
    operation_id: str
    instance_id: str
    operation: OperationStatus | None = None


class ErrorResponse(_Strict):
    """A request that could not be parsed, validated or authorized (HTTP 400, 401, 413)."""

    error: str
    details: list[str] = Field(default_factory=list)
    operation_id: str | None = Field(
        default=None, description="The request's operation_id when it could be read."
    )
    instance_id: str | None = Field(default=None, description="The server's instance_id.")


# Our own errors already name the field and the fix.
_SELF_DESCRIBING_ERRORS = frozenset(
    {"int_type", "id_format", "greater_than_equal", "missing_target", "conflicting_target"}
)


def describe_validation_error(exc: ValidationError) -> ErrorResponse:
    """Turn a pydantic error into messages that name the field and the fix."""
    details: list[str] = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            details.append(
                f"unknown field '{loc}'; allowed fields: {', '.join(SCALE_REQUEST_FIELDS)}"
            )
        elif err["type"] == "string_too_long":
            details.append(f"{loc} is longer than {ID_MAX_LENGTH} characters; shorten it")
        elif err["type"] == "model_type":
            details.append('the body must be a JSON object such as {"new_ep_size": 4}')
        elif loc and err["type"] not in _SELF_DESCRIBING_ERRORS:
            details.append(f"{loc}: {err['msg']}")
        else:
            details.append(err["msg"])
    return ErrorResponse(error="invalid scale request: " + "; ".join(details), details=details)


class RankState(str, enum.Enum):
    ACTIVE = "active"
    PENDING = "pending"  # inside a running scale-up target, not yet admitted
    FAILED = "failed"
    LEAVING = "leaving"  # being removed by a running scale-down
    SAFE_TO_TERMINATE = "safe_to_terminate"  # released; its process may be deleted
    INACTIVE = "inactive"  # a reserved slot up to --max-ep-size, never used or long gone


class RankStatus(_Strict):
    rank: int
    state: RankState
    experts: list[int] | None = Field(
        default=None,
        description="Logical experts with a replica on this rank (first MoE layer), as the "
        "engine last reported them; null when not reported or the rank serves none.",
    )
    expert_slots: list[int] | None = Field(
        default=None,
        description="The logical expert in each of this rank's physical slots (first MoE "
        "layer), in slot order; an EPLB rebalance or an expert move changes it.",
    )


class PhaseTimestamp(_Strict):
    phase: Phase
    at: float


class OperationResult(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # called off before its commit point; the size did not change


class OperationKind(str, enum.Enum):
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    NOOP = "noop"  # target equals the current size; recorded only with an operation_id


class OperationStatus(_Strict):
    operation_id: str
    kind: OperationKind
    old_ep_size: int
    new_ep_size: int
    phase: Phase
    phase_timestamps: list[PhaseTimestamp]
    started_at: float
    finished_at: float | None = None
    duration_s: float | None = None
    result: OperationResult
    error: str | None = None


class RankPosition(_Strict):
    """Where one scheduler is, from the report it publishes once a second while it runs (even
    while its main thread waits in a collective)."""

    rank: int
    step: str = Field(description="The step of its pass it is in: `gather` (the DP-attention "
                      "all-gather every pass starts with), `forward`, `idle`, or a membership "
                      "step (`scale-up to N`, `scale-down to N`, `let go of failed ranks`).")
    in_step_s: float = Field(description="Seconds since it entered that step.")
    passes: int = Field(description="Passes it has gathered since it started.")
    report_age_s: float = Field(description="Seconds since its last report: more than a few "
                                "means the process itself stopped or died.")


class StallStatus(_Strict):
    """Serving has stalled for ``stalled_s``: requests wait and no scheduler answered, or no
    request waits and a serving scheduler has not left one step of a pass."""

    since: float = Field(description="When the schedulers last answered (or requests began "
                         "to wait, if later); with no request waiting, when the longest-stuck "
                         "scheduler entered its step.")
    stalled_s: float
    waiting_requests: int
    phase: Phase = Field(description="The phase the deployment was in (the step it is stuck "
                         "in when an operation runs).")
    ranks: list[RankPosition] = Field(
        default_factory=list,
        description="Each scheduler's step and how long it has been in it (empty when the "
                    "reports cannot be read: no --dist-init-addr, or rank 0, which hosts them, "
                    "is stopped itself).")
    count_out_s: float | None = Field(
        default=None,
        description="How long Mooncake takes to take a silent member (dead, or stopped whole) "
                    "out of every group: its heartbeat timeout, the fault window and the "
                    "collective timeout. Past it, the live ranks of a stall wait on each other.")
    ranks_to_relaunch: list[int] = Field(
        default_factory=list,
        description="The ranks whose end frees the others' passes, and those Mooncake counted "
                    "out: end each one's process and relaunch it with --ep-join-mode recover "
                    "and its original arguments. A rank of rank 0's server (which hosts the "
                    "HTTP server) is listed only when nothing else frees the others: then only "
                    "a restart does. Empty when the positions are unknown.")
    message: str


class StatusResponse(_Strict):
    """``GET /elastic_ep/status``."""

    instance_id: str
    phase: Phase
    effective_ep_size: int
    pending_ep_size: int | None
    max_ep_size: int
    ranks: list[RankStatus]
    safe_to_terminate_ranks: list[int] = Field(default_factory=list)
    current_operation: OperationStatus | None = None
    recent_operations: list[OperationStatus] = Field(
        default_factory=list, description="Finished operations, newest first."
    )
    last_error: str | None = None
    stalled: StallStatus | None = Field(
        default=None, description="Set while requests wait and no scheduler answers."
    )
    eplb_rebalances: list[int] = Field(
        default_factory=list,
        description="The EP size at each EPLB rebalance that installed a new expert layout "
        "since launch, oldest first (empty without --enable-eplb).",
    )


class ExpertHealthStatus(_Strict):
    physical_expert: int
    rank: int
    latency_s: float | None
    healthy: bool


class RankHealthStatus(_Strict):
    rank: int
    alive: bool
    healthy: bool
    consecutive_unhealthy_checks: int
    total_unhealthy_checks: int
    hard_blocked: bool
    unhealthy_experts: list[int] = Field(default_factory=list)


class HealthResponse(_Strict):
    """``GET /elastic_ep/health``."""

    instance_id: str
    checks: int
    latency_threshold: float = Field(description="An expert is slow above this x median.")
    persistence_threshold: int = Field(
        description="Consecutive unhealthy checks after which a rank is hard-blocked."
    )
    median_latency_s: float | None
    ranks: list[RankHealthStatus]
    experts: list[ExpertHealthStatus]
    stalled: StallStatus | None = Field(
        default=None, description="Set while requests wait and no scheduler answers."
    )


# --- events -------------------------------------------------------------------------------


class _EventBase(_Strict):
    type: str  # narrowed to a Literal by every concrete event
    event_id: int = Field(ge=1, description="Monotonic per instance; use as SSE Last-Event-ID.")
    time: float
    instance_id: str


class ScaleRequestedEvent(_EventBase):
    type: Literal["scale_requested"] = "scale_requested"
    operation_id: str
    old_ep_size: int
    new_ep_size: int
    ranks: list[int] = Field(description="Ranks that will join (up) or leave (down).")


class RankJoinedEvent(_EventBase):
    type: Literal["rank_joined"] = "rank_joined"
    operation_id: str | None = None
    ranks: list[int]


class RankFailedEvent(_EventBase):
    type: Literal["rank_failed"] = "rank_failed"
    operation_id: str | None = None
    ranks: list[int]
    reason: str


class RankRecoveredEvent(_EventBase):
    type: Literal["rank_recovered"] = "rank_recovered"
    operation_id: str | None = None
    ranks: list[int]


class ScaleCommittedEvent(_EventBase):
    type: Literal["scale_committed"] = "scale_committed"
    operation_id: str
    old_ep_size: int
    new_ep_size: int
    duration_s: float
    ranks: list[int] = Field(description="Ranks that joined (up) or left (down).")


class ScaleFailedEvent(_EventBase):
    type: Literal["scale_failed"] = "scale_failed"
    operation_id: str
    old_ep_size: int
    new_ep_size: int
    failed_in: Phase
    error: str
    ranks: list[int]


class ScaleCancelledEvent(_EventBase):
    type: Literal["scale_cancelled"] = "scale_cancelled"
    operation_id: str
    old_ep_size: int
    new_ep_size: int
    ranks: list[int] = Field(description="Ranks that were to join: safe to terminate now.")


class RecoveryRequiredEvent(_EventBase):
    type: Literal["recovery_required"] = "recovery_required"
    operation_id: str | None = None
    ranks: list[int]
    reason: str
    suggested_action: str


class SafeToTerminateEvent(_EventBase):
    type: Literal["safe_to_terminate"] = "safe_to_terminate"
    operation_id: str | None = None
    ranks: list[int]


Event = Annotated[
    ScaleRequestedEvent
    | RankJoinedEvent
    | RankFailedEvent
    | RankRecoveredEvent
    | ScaleCommittedEvent
    | ScaleFailedEvent
    | ScaleCancelledEvent
    | RecoveryRequiredEvent
    | SafeToTerminateEvent,
    Field(discriminator="type"),
]

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

EVENT_TYPES: tuple[type[_EventBase], ...] = (
    ScaleRequestedEvent,
    RankJoinedEvent,
    RankFailedEvent,
    RankRecoveredEvent,
    ScaleCommittedEvent,
    ScaleFailedEvent,
    ScaleCancelledEvent,
    RecoveryRequiredEvent,
    SafeToTerminateEvent,
)

EventModel = _EventBase  # public name for "any event" in type hints
