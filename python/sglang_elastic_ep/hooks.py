"""Every hook this plugin installs into SGLang 0.5.23, each with one line on why.

Nothing outside this table patches SGLang. Every hook passes straight through unless elastic EP
flags were given, so a server started without them behaves exactly as upstream. The CPU testbed
(a separate package) registers its own CPU-engine hooks through its own plugin and table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

S = "sglang.srt."
NIXL = f"{S}layers.moe.token_dispatcher.nixl.NixlEPBuffer"
EEP = f"{S}elastic_ep.elastic_ep"
DPA = f"{S}managers.scheduler_components.dp_attn"
PACKAGE = "sglang_elastic_ep"

HookKind = Literal["BEFORE", "AFTER", "AROUND", "REPLACE"]


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path handed to HookRegistry.register
    impl: str  # "module:function" inside ``package``
    kind: HookKind
    why: str
    package: str = PACKAGE

    def resolve(self) -> Callable:
        module, _, name = self.impl.partition(":")
        return getattr(importlib.import_module(f"{self.package}.{module}"), name)


def register(hooks: tuple[Hook, ...]) -> None:
    """Hand ``hooks`` to SGLang's own registry (the testbed's plugin calls this too)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in hooks:
        HookRegistry.register(hook.target, hook.resolve(), HookType[hook.kind])


HOOKS: tuple[Hook, ...] = (
    # --- arguments -------------------------------------------------------------------------
    Hook(f"{S}server_args.ServerArgs.add_cli_args", "sglang.args:add_cli_args", "AFTER",
         "adds --ep-join-mode, --elastic-ep-drain-timeout and the Mooncake timeout flags"),
    Hook(f"{S}server_args.ServerArgs.from_cli_args", "sglang.args:from_cli_args", "AFTER",
         "copies our flags onto ServerArgs and resolves --ep-join-mode vs --elastic-ep-join-mode"),
    Hook(f"{S}arg_groups.parallel_hook.handle_elastic_ep", "sglang.args:check_elastic_ep_args",
         "AROUND",
         "upstream refuses a joiner below the launch size; one refilling a slot a scale-down "
         "released appends at its offset like any joiner"),
    # --- NIXL data plane (sglang/nixl_buffer_hooks.py; each is upstream's own without elastic EP)
    Hook(f"{NIXL}.on_scale", "sglang.nixl_buffer_hooks:hook_nixl_on_scale", "AROUND",
         "record the target size only; connect/disconnect happen at the next dispatch, in order"),
    Hook(f"{NIXL}.get_nixl_buffer", "sglang.nixl_buffer_hooks:hook_nixl_get_nixl_buffer",
         "AROUND",
         "buffer pre-sized for --max-ep-size; membership connects, and disconnects on scale-down"),
    Hook(f"{EEP}.ElasticEPState.is_active_equal_last",
         "sglang.nixl_buffer_hooks:hook_is_active_equal_last", "AROUND",
         "per-forward check reads the host mirror instead of torch.equal on CUDA tensors"),
    Hook(f"{EEP}.ElasticEPState.snapshot_active_to_last",
         "sglang.nixl_buffer_hooks:hook_after_snapshot_active_to_last", "AFTER",
         "keep the mirror's snapshot in step with last_active_ranks"),
    Hook(f"{EEP}.ElasticEPState.sync_active_to_cpu",
         "sglang.nixl_buffer_hooks:hook_after_sync_active_to_cpu", "AFTER",
         "membership event: refresh the mirror from the host copy; log experts with no replica"),
    Hook(f"{EEP}.maybe_recover_ep_ranks", "sglang.nixl_buffer_hooks:hook_maybe_recover_ep_ranks",
         "AROUND",
         "recovery poll reads the mirror of tp_group.active_ranks, no .all()/.cpu() per forward"),
    # --- expert dispatch (sglang/expert_dispatch.py) --------------------------------------
    Hook(f"{S}eplb.expert_location_dispatch.topk_ids_logical_to_physical",
         "sglang.expert_dispatch:topk_ids_logical_to_physical", "AROUND",
         "picks on inactive ranks move to live replicas (-1 if none) from the next forward on"),
    Hook(f"{S}eplb.expert_location_dispatch.ExpertLocationDispatchInfo.init_new",
         "sglang.expert_dispatch:dispatch_info_with_layer", "AROUND",
         "the repair step needs the layer's full replica list; upstream's is collapsed to the "
         "nearest replica with an a2a backend"),
    Hook(f"{S}eplb.expert_location.ExpertLocationMetadata.update",
         "sglang.layout_hooks:layout_installed", "AFTER",
         "EPLB rewrites the layout in place: the repair step's replica tables follow it, and "
         "the install is counted (a rebalance that installed one is told apart)"),
    Hook(f"{S}eplb.eplb_manager.EPLBManager.rebalance", "sglang.eplb_log:rebalance_recorded",
         "AROUND", "the status lists the EP size at each EPLB rebalance (proof it ran there)"),
    Hook(f"{S}eplb.eplb_algorithms.rebalance_experts",
         "sglang.eplb_spread:rebalance_experts_spread", "AROUND",
         "--elastic-ep-expert-min-ranks: every EPLB layout keeps each expert on that many "
         "ranks, so a rank fault leaves every expert served"),
    Hook(f"{S}eplb.eplb_algorithms.elasticity_aware.rebalance_experts",
         "sglang.eplb_spread:elasticity_aware_over_layout_ranks", "AROUND",
         "upstream adds an empty rank per inactive entry of active_ranks (sized to "
         "--max-ep-size): a layout wider than the world kills the scheduler after a fault"),
    Hook(f"{S}eplb.expert_location._compute_elastic_expert_layout",
         "sglang.layout_checks:elastic_expert_layout", "AROUND",
         "experts that do not split over the launch ranks: a startup error naming the "
         "--ep-num-redundant-experts values that do (upstream's assert has no message)"),
    Hook(f"{S}eplb.expert_location_updater.ExpertLocationUpdater.update",
         "sglang.weight_transfers:update_without_joiner_p2p", "AROUND",
         "the pinned Mooncake aborts on P2P with ranks added after launch: weight moves that "
         "involve a scale-joined rank load from the checkpoint instead"),
    Hook(f"{S}layers.moe.fused_moe_triton.layer.FusedMoE.weight_loader",
         "sglang.replica_loading:weight_loader_every_replica", "AROUND",
         "upstream loads one replica per expert per rank (the collapsed list); a layout with "
         "two replicas on one rank would leave the second unloaded"),
    Hook(f"{S}model_executor.model_runner.ModelRunner.maybe_join_ep_ranks",
         "sglang.scale_progress:agreed_join_step", "AROUND",
         "rank agreement: enter membership collectives only on the pass the gathered verdict "
         "says every rank is ready for the same change"),
    Hook(f"{S}managers.tp_worker.TpModelWorker.forward_batch_generation",
         "sglang.pass_faults:forward_watched", "AROUND",
         "a peer that dies inside a forward leaves that forward's tokens and KV wrong (routing "
         "avoids it only from the next one): flag the pass, with no host sync"),
    Hook(f"{S}managers.scheduler_components.batch_result_processor."
         "SchedulerBatchResultProcessor.process_batch_result_prefill",
         "sglang.pass_faults:end_requests_of_a_faulted_pass", "AROUND",
         "a flagged pass's requests end with 503 and stay out of the prefix cache"),
    Hook(f"{S}managers.scheduler_components.batch_result_processor."
         "SchedulerBatchResultProcessor.process_batch_result_decode",
         "sglang.pass_faults:end_requests_of_a_faulted_pass", "AROUND",
         "a flagged pass's requests end with 503 and stay out of the prefix cache"),
    Hook(f"{S}managers.scheduler.Scheduler.get_next_batch_to_run",
         "sglang.scale_progress:progress_membership_when_idle", "AFTER",
         "upstream advances a scale only after forward passes; idle servers never did. Here, not"
         " in on_idle: every rank sees 'no batch' on the same iteration, on_idle it may skip;"
         " also marks each loop iteration for the agreement"),
    Hook(f"{S}managers.scheduler.Scheduler.handle_scale_elastic_ep",
         "sglang.scale_down:handle_scale_request", "AROUND",
         "a target below the effective size is a scale-down (upstream refuses it)"),
    Hook(f"{S}managers.tokenizer_manager.TokenizerManager.forward_elastic_scale_update",
         "sglang.tokenizer_hooks:apply_scale_update", "AROUND",
         "a committed scale-down shrinks the tokenizer's worker count (upstream only grows)"),
    Hook(f"{DPA}._resolve_elastic_world_num_dp_ranks",
         "sglang.tail_recovery:world_gather_width", "AROUND",
         "a scale-joined rank's death shrinks WORLD under the DP gather; upstream raises and "
         "kills every scheduler"),
    Hook(f"{DPA}.MLPSyncBatchInfo.all_gather", "sglang.gather_agreement:gather_with_agreement",
         "AROUND",
         "every rank reads the membership verdict from the same gathered rows, on the same pass;"
         " over the expanded WORLD a dead joiner's row is blanked with WORLD's mask (upstream "
         "uses the launch-time TP group's, which has no entry for it), and the all-reduce inside"
         " runs through a handle so a survivor of a peer's death mid-gather repairs its rows "
         "(upstream drops the handle that says the peer failed)"),
    Hook(f"{DPA}.prepare_mlp_sync_batch_raw", "sglang.gather_agreement:bracket_mlp_sync",
         "AROUND",
         "the agreement's inputs need the pass's model runner and batch, which all_gather "
         "does not receive"),
    Hook(f"{DPA}.MLPSyncBatchInfo._get_local_tensor",
         "sglang.gather_agreement:append_agreement_columns", "AROUND",
         "this rank's gather row carries its membership proposal, expert timings and a check "
         "value: the agreement needs no collective of its own"),
    Hook(f"{DPA}.MLPSyncBatchInfo._get_fallback_tensor",
         "sglang.gather_agreement:append_blank_columns", "AROUND",
         "rows no rank wrote (and inactive ranks' rows) must be as wide as the others and "
         "carry no proposal"),
    Hook(f"{S}distributed.parallel_state.init_distributed_environment",
         "sglang.world_registration:init_distributed_environment", "AROUND",
         "Mooncake reads its timeouts when WORLD registers, and refuses a registration shorter "
         "than the longest rank order it reached: after a shrink a scale joiner registers for "
         "that size, not its top slot + 1"),
    Hook(f"{S}model_executor.model_runner.ModelRunner._initialize_elastic_ep_joiner",
         "sglang.scale_up_joiner:prepare_then_join", "AROUND",
         "a joiner prepares (NIXL buffer, KV cache) before it registers, while the serving ranks "
         "serve on; upstream registers first and they wait for it from admission to commit"),
    Hook(f"{S}model_executor.model_runner.join_scale_process_group",
         "sglang.scale_up_joiner:join_world", "AROUND",
         "a scale joiner's side of the scale-up runs as a machine; its start-up steps block, so "
         "each one's end is told to it: here its wait for admission"),
    Hook(f"{S}model_executor.model_runner.ModelRunner._finalize_elastic_ep_joiner",
         "sglang.scale_up_joiner:commit_joining", "AROUND",
         "a prepared joiner's admission, then its commit barrier with the serving ranks"),
    Hook(f"{S}model_executor.model_runner.ModelRunner._elastic_scale_ready_barrier",
         "sglang.commit_barrier:agreed_commit_barrier", "AROUND",
         "NIXL handshakes with the new ranks before the commit, both sides at once (upstream "
         "connects at the first dispatch after it); the barrier also agrees whether every "
         "joiner is still in Mooncake's WORLD (its collectives skip one it gave up on)"),
    Hook(f"{S}model_executor.model_runner.ModelRunner._finalize_scale_up",
         "sglang.commit_barrier:serving_rank_commit", "AROUND",
         "tells the barrier inside it this rank's side (a rank that joined earlier keeps the "
         "joiner flag); upstream's commit marks every new slot live: joiners the barrier "
         "counted out are marked failed after it, so the survivors let their slots go"),
    Hook(f"{S}model_executor.model_runner.broadcast_global_expert_location_metadata",
         "sglang.expert_map_broadcast:checked_expert_map_broadcast", "AROUND",
         "Mooncake completes a broadcast whose joiner hung and leaves the source's map "
         "overwritten: the source keeps what it sent before the metadata is built from it"),
    Hook(f"{EEP}.broadcast_global_expert_location_metadata",
         "sglang.expert_map_broadcast:checked_expert_map_broadcast", "AROUND",
         "the same broadcast when survivors take a replacement back"),
    Hook(f"{S}model_executor.model_runner.ModelRunner.post_capture_elastic_ep_recover",
         "sglang.launch_recovery:rejoin_then_reload_moved_experts", "AROUND",
         "a replacement loaded its experts for the launch layout; EPLB or a scale-down may have "
         "moved others into its slots since"),
    Hook(f"{EEP}.get_healthy_expert_location_src_rank",
         "sglang.launch_recovery:healthy_source_rank", "AROUND",
         "upstream gathers over its launch-time `world` group, which differs between ranks "
         "after a scale; one all-reduce over WORLD also tells a replacement the serving size"),
    Hook(f"{EEP}._try_recover_world", "sglang.world_view:admit_then_wait_for_view", "AROUND",
         "the members meet before the admission (a slow member's flag clear would wipe the "
         "first flag of the broadcast after it) and each waits for the new view after it, "
         "which also tells whether a rank's own failed proposal was made by the others"),
    Hook(f"{EEP}._wait_for_peer_state", "sglang.world_view:wait_for_group_peers", "AROUND",
         "upstream waits forever for a replacement to register in each launch-time group; "
         "one killed as it is taken back never does, and the survivors would stop serving"),
    Hook(f"{EEP}._maybe_create_message_queue", "sglang.world_view:group_queue_unless_gone",
         "AROUND",
         "the group's message queue then waits on zmq with no end for every member to "
         "subscribe; a replacement killed right after its group took it back never does"),
    Hook(f"{EEP}.maybe_rebalance_after_rank_fault",
         "sglang.scale_progress:rebalance_after_rank_fault", "AROUND",
         "without --enable-eplb upstream dereferences a None EPLB manager on a rank fault"),
    Hook(f"{S}managers.scheduler.Scheduler.get_internal_state",
         "sglang.expert_health:add_report", "AFTER",
         "rank 0's answer carries every rank's expert timings (the health monitor polls it)"),
    Hook(f"{S}managers.scheduler.Scheduler.set_internal_state",
         "sglang.expert_health:take_blocked_ranks", "AROUND",
         "the HTTP process blocks ranks with slow experts; upstream rejects unknown keys"),
    Hook(f"{S}managers.data_parallel_controller.sock_send",
         "sglang.worker_sends:send_to_worker", "AROUND",
         "a PUSH send to a dead joiner's slot blocks the DP controller (and all serving) "
         "forever; send non-blocking and drop, the tokenizer 503s what that shard held"),
    # --- orchestrator contract ---------------------------------------------------------
    Hook(f"{S}entrypoints.http_server.set_global_state", "sglang.server_mount:mount_on_server",
         "AFTER",
         "mounts operation ids, status, SSE events, health on the app (elastic EP only)"),
    Hook(f"{S}managers.tokenizer_manager.TokenizerManager.update_active_ranks",
         "sglang.tokenizer_hooks:mirror_active_ranks", "AFTER",
         "shard liveness -> rank_failed/rank_recovered; a dead shard's requests end with 503"),
    Hook(f"{S}managers.scheduler.Scheduler._maybe_report_active_ranks",
         "sglang.shard_liveness:report_from_rank_zero_only", "AROUND",
         "only rank 0 reports shard liveness: survivors learn of a death on different passes, "
         "and their reports alternating made the dead shard fail, recover and fail again"),
    Hook(f"{S}managers.tokenizer_manager.TokenizerManager._dispatch_to_scheduler",
         "sglang.tokenizer_hooks:route_to_live_shard", "BEFORE",
         "route round-robin in the tokenizer, which then knows the requests a dead shard held"),
    Hook(f"{S}managers.data_parallel_controller.DataParallelController.__init__",
         "sglang.server_exit:watch_schedulers", "AFTER",
         "above node 0, a scheduler that crashed ends its DP controller with exit 1; upstream "
         "joined the others and exited 0"),
    Hook(f"{S}entrypoints.engine.Engine._launch_scheduler_processes",
         "sglang.server_exit:exit_non_zero_after_a_crash", "AROUND",
         "above node 0, a server whose ranks crashed exits 1 (upstream returned, exit 0), so an "
         "orchestrator that restarts on failure relaunches it"),
)
