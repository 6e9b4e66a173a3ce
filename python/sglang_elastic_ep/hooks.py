"""Every hook this plugin installs into SGLang 0.5.23, each with one line on why.

Nothing outside this table patches SGLang. A hook's ``scope`` says when it is installed:
``cpu`` only with the CPU engine (``SGLANG_USE_CPU_ENGINE=1``), ``all`` always. ``all`` hooks
pass straight through unless elastic EP flags were given, so a server started without them
behaves exactly as upstream.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Scope = Literal["all", "cpu"]
S = "sglang.srt."
NIXL = f"{S}layers.moe.token_dispatcher.nixl.NixlEPBuffer"
EEP = f"{S}elastic_ep.elastic_ep"


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path handed to HookRegistry.register
    impl: str  # "module:function" inside this package
    kind: Literal["BEFORE", "AFTER", "AROUND", "REPLACE"]
    scope: Scope
    why: str

    def resolve(self) -> Callable:
        module, _, name = self.impl.partition(":")
        return getattr(importlib.import_module(f"sglang_elastic_ep.{module}"), name)


@dataclass(frozen=True)
class ImportShim:
    """A module provided under another name when the real one cannot load (CPU engine only)."""

    name: str
    impl: str
    scope: Scope
    why: str

    def install(self) -> None:
        module, _, name = self.impl.partition(":")
        getattr(importlib.import_module(f"sglang_elastic_ep.{module}"), name)()


HOOKS: tuple[Hook, ...] = (
    # --- arguments -------------------------------------------------------------------------
    Hook(f"{S}server_args.ServerArgs.add_cli_args", "sglang.args:add_cli_args", "AFTER", "all",
         "adds --ep-join-mode, --elastic-ep-drain-timeout and the Mooncake timeout flags"),
    Hook(f"{S}server_args.ServerArgs.from_cli_args", "sglang.args:from_cli_args", "AFTER", "all",
         "copies our flags onto ServerArgs and resolves --ep-join-mode vs --elastic-ep-join-mode"),
    # --- NIXL data plane (sglang/nixl_buffer_hooks.py; each is upstream's own without elastic EP)
    Hook(f"{NIXL}.on_scale", "sglang.nixl_buffer_hooks:hook_nixl_on_scale", "AROUND", "all",
         "record the target size only; connect/disconnect happen at the next dispatch, in order"),
    Hook(f"{NIXL}.get_nixl_buffer", "sglang.nixl_buffer_hooks:hook_nixl_get_nixl_buffer",
         "AROUND", "all",
         "buffer pre-sized for --max-ep-size; membership connects, and disconnects on scale-down"),
    Hook(f"{EEP}.ElasticEPState.is_active_equal_last",
         "sglang.nixl_buffer_hooks:hook_is_active_equal_last", "AROUND", "all",
         "per-forward check reads the host mirror instead of torch.equal on CUDA tensors"),
    Hook(f"{EEP}.ElasticEPState.snapshot_active_to_last",
         "sglang.nixl_buffer_hooks:hook_after_snapshot_active_to_last", "AFTER", "all",
         "keep the mirror's snapshot in step with last_active_ranks"),
    Hook(f"{EEP}.ElasticEPState.sync_active_to_cpu",
         "sglang.nixl_buffer_hooks:hook_after_sync_active_to_cpu", "AFTER", "all",
         "membership event: refresh the mirror from the host copy; log experts with no replica"),
    Hook(f"{EEP}.maybe_recover_ep_ranks", "sglang.nixl_buffer_hooks:hook_maybe_recover_ep_ranks",
         "AROUND", "all",
         "recovery poll reads the mirror of tp_group.active_ranks, no .all()/.cpu() per forward"),
    # --- expert dispatch (sglang/expert_dispatch.py) --------------------------------------
    Hook(f"{S}eplb.expert_location_dispatch.topk_ids_logical_to_physical",
         "sglang.expert_dispatch:topk_ids_logical_to_physical", "AROUND", "all",
         "picks on inactive ranks move to live replicas (-1 if none) from the next forward on"),
    Hook(f"{S}eplb.expert_location_dispatch.ExpertLocationDispatchInfo.init_new",
         "sglang.expert_dispatch:dispatch_info_with_layer", "AROUND", "all",
         "the repair step needs the layer's full replica list; upstream's is collapsed to the "
         "nearest replica with an a2a backend"),
    Hook(f"{S}model_executor.model_runner.ModelRunner.maybe_join_ep_ranks",
         "sglang.scale_progress:agreed_join_step", "AROUND", "all",
         "rank agreement: enter membership collectives only when every rank sees the scale"),
    Hook(f"{S}managers.scheduler.Scheduler.get_next_batch_to_run",
         "sglang.scale_progress:progress_membership_when_idle", "AFTER", "all",
         "upstream advances a scale only after forward passes; idle servers never did. Here, not"
         " in on_idle: every rank sees 'no batch' on the same iteration, on_idle it may skip"),
    Hook(f"{S}managers.scheduler.Scheduler.on_idle",
         "sglang.scale_progress:idle_pass", "AROUND", "cpu",
         "Mooncake's spinning worker stays parked during idle housekeeping and the poll"),
    Hook(f"{S}managers.scheduler.Scheduler.handle_scale_elastic_ep",
         "sglang.scale_down:handle_scale_request", "AROUND", "all",
         "a target below the effective size is a scale-down (upstream refuses it)"),
    Hook(f"{S}managers.tokenizer_manager.TokenizerManager.forward_elastic_scale_update",
         "sglang.http_adapter:apply_scale_update", "AROUND", "all",
         "a committed scale-down shrinks the tokenizer's worker count (upstream only grows)"),
    Hook(f"{S}managers.scheduler_components.dp_attn._resolve_elastic_world_num_dp_ranks",
         "sglang.tail_recovery:world_gather_width", "AROUND", "all",
         "a scale-joined rank's death shrinks WORLD under the DP gather; upstream raises and "
         "kills every scheduler"),
    Hook(f"{S}managers.scheduler_components.dp_attn.MLPSyncBatchInfo.all_gather",
         "sglang.tail_recovery:gather_masks_expanded_world", "AROUND", "all",
         "over the expanded WORLD a dead joiner's row must be blanked with WORLD's mask; "
         "upstream uses the launch-time TP group's, which has no entry for it"),
    Hook(f"{EEP}._try_recover_world", "sglang.world_view:admit_then_wait_for_view", "AROUND",
         "all", "Mooncake applies an admission's view in the background; the next collective "
         "(the expert-map broadcast) must not start on a rank still on the old view"),
    Hook(f"{EEP}.maybe_rebalance_after_rank_fault",
         "sglang.scale_progress:rebalance_after_rank_fault", "AROUND", "all",
         "without --enable-eplb upstream dereferences a None EPLB manager on a rank fault"),
    Hook(f"{S}managers.scheduler.Scheduler.get_internal_state",
         "sglang.expert_health:add_report", "AFTER", "all",
         "rank 0's answer carries every rank's expert timings (the health monitor polls it)"),
    Hook(f"{S}managers.scheduler.Scheduler.set_internal_state",
         "sglang.expert_health:take_blocked_ranks", "AROUND", "all",
         "the HTTP process blocks ranks with slow experts; upstream rejects unknown keys"),
    Hook(f"{S}managers.data_parallel_controller.sock_send",
         "sglang.worker_sends:send_to_worker", "AROUND", "all",
         "a PUSH send to a dead joiner's slot blocks the DP controller (and all serving) "
         "forever; send non-blocking and drop, the tokenizer 503s what that shard held"),
    # --- orchestrator contract ---------------------------------------------------------
    Hook(f"{S}entrypoints.http_server.set_global_state", "sglang.http_adapter:mount_on_server",
         "AFTER", "all",
         "mounts operation ids, status, SSE events, health on the app (elastic EP only)"),
    Hook(f"{S}managers.tokenizer_manager.TokenizerManager.update_active_ranks",
         "sglang.http_adapter:mirror_active_ranks", "AFTER", "all",
         "shard liveness -> rank_failed/rank_recovered; a dead shard's requests end with 503"),
    Hook(f"{S}managers.tokenizer_manager.TokenizerManager._dispatch_to_scheduler",
         "sglang.http_adapter:route_to_live_shard", "BEFORE", "all",
         "route round-robin in the tokenizer, which then knows the requests a dead shard held"),
    # --- CPU engine ------------------------------------------------------------------------
    Hook(f"{S}distributed.bootstrap._resolve_backend", "cpu.mooncake_cpu:resolve_backend",
         "AFTER", "cpu", "upstream picks the mooncake backend only on CUDA; CPU: mooncake-cpu"),
    Hook(f"{S}distributed.parallel_state.init_distributed_environment",
         "cpu.mooncake_cpu:init_distributed_environment", "AROUND", "cpu",
         "remembers max_world_size/recovered_rank so WORLD on mooncake-cpu gets elastic options"),
    Hook("torch.distributed.distributed_c10d.init_process_group",
         "cpu.mooncake_cpu:init_process_group", "AROUND", "cpu",
         "upstream builds Mooncake WORLD options with a CUDA tensor; CPU builds them on CPU; "
         "a scale joiner asks for the largest WORLD so far (Mooncake keeps it after a shrink)"),
    Hook("torch.distributed.distributed_c10d.new_group", "cpu.mooncake_cpu:new_group", "AROUND",
         "cpu", "GroupCoordinator hard-codes backend='mooncake' (CUDA) for device groups"),
    Hook(f"{S}layers.attention.torch_native_backend.TorchNativeAttnBackend.__init__",
         "cpu.attention:add_cpu_graph_fill_value", "AFTER", "cpu",
         "DP-attention padding on CPU calls get_cpu_graph_seq_len_fill_value (AMX-only upstream)"),
    Hook(f"{S}distributed.parallel_state.GroupCoordinator.reduce_scatterv",
         "cpu.collectives:reduce_scatterv", "AROUND", "cpu",
         "upstream reduce_scatterv needs pynccl; on CPU all-reduce and keep this rank's slice"),
    Hook(f"{S}managers.scheduler.Scheduler.init_idle_sleeper", "cpu.idle:install_idle_sleeper",
         "AFTER", "cpu",
         "idle ranks poll 5 ms, not 1 s, and park Mooncake's spinning worker meanwhile"),
    Hook(f"{S}server_args.wait_port_available", "cpu.shared_host:wait_port_available",
         "AROUND", "cpu",
         "a node relaunched on node 0's host (CPU cluster) must not wait for node 0's ports"),
    Hook(f"{S}managers.data_parallel_controller.DataParallelController.event_loop",
         "cpu.idle:dp_controller_event_loop", "REPLACE", "cpu",
         "upstream's DP controller busy-polls its socket; block in zmq poll until a request"),
    Hook(f"{S}layers.moe.token_dispatcher.nixl._load_nixl_ep", "cpu.nixl_ep:load_nixl_ep",
         "REPLACE", "cpu", "nixl_ep needs a GPU; the CPU buffer moves host memory over real NIXL"),
    Hook(f"{S}layers.moe.token_dispatcher.nixl._NixlEPDispatcherImplBase.__init__",
         "cpu.nixl_ep:dispatcher_impl_init", "AROUND", "cpu",
         "upstream allocates the NIXL mask buffer on 'cuda'; allocate it on CPU"),
    Hook(f"{S}layers.moe.ep_moe.layer.DeepEPMoE.run_moe_core", "cpu.nixl_ep:run_moe_core",
         "AROUND", "cpu", "experts compute on the packed low-latency layout NIXL EP delivers"),
    Hook(f"{S}layers.moe.fused_moe_native.moe_forward_native", "cpu.moe:moe_forward_native",
         "REPLACE", "cpu",
         "EP on CPU: non-local experts arrive as id -1 and must contribute nothing; 0 tokens ok"),
)

IMPORT_SHIMS: tuple[ImportShim, ...] = (
    ImportShim("sgl_kernel", "cpu.sgl_kernel_ops:install", "cpu",
               "the CPU sgl_kernel build is not on PyPI: torch versions of the ops SGLang calls"),
    ImportShim("torchvision", "cpu.torchvision_shim:install", "cpu",
               "PyPI torchvision is a CUDA build that cannot import beside CPU torch; SGLang "
               "imports it at module level for image models we never serve on CPU"),
    ImportShim("torch.cpu.empty_cache", "cpu.torch_compat:install", "cpu",
               "EPLB calls torch.<device>.empty_cache, which CPU torch lacks"),
)


def cpu_engine() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"


def _in_scope(scope: Scope) -> bool:
    return scope == "all" or (scope == "cpu" and cpu_engine())


def active_hooks() -> list[Hook]:
    return [h for h in HOOKS if _in_scope(h.scope)]


def active_import_shims() -> list[ImportShim]:
    return [s for s in IMPORT_SHIMS if _in_scope(s.scope)]
