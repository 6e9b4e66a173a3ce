"""Every hook the CPU testbed installs into SGLang 0.5.23, each with one line on why.

Installed by the testbed's own plugin (``elastic_ep_testbed``) and only with the CPU engine
(``SGLANG_USE_CPU_ENGINE=1``). They make real SGLang server processes, Mooncake process groups
and a NIXL EP buffer run on a machine without a GPU; the product's hooks
(``sglang_elastic_ep.hooks``) are the same on CPU and GPU.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from sglang_elastic_ep.hooks import Hook, HookKind, S

PACKAGE = "sglang_elastic_ep_testbed"


def _cpu_hook(target: str, impl: str, kind: HookKind, why: str) -> Hook:
    return Hook(target, impl, kind, why, package=PACKAGE)


@dataclass(frozen=True)
class ImportShim:
    """A module provided under another name when the real one cannot load on CPU."""

    name: str
    impl: str
    why: str

    def install(self) -> None:
        module, _, name = self.impl.partition(":")
        getattr(importlib.import_module(f"{PACKAGE}.{module}"), name)()


HOOKS: tuple[Hook, ...] = (
    _cpu_hook(f"{S}distributed.bootstrap._resolve_backend", "cpu.mooncake_cpu:resolve_backend",
              "AFTER", "upstream picks the mooncake backend only on CUDA; CPU: mooncake-cpu"),
    _cpu_hook("torch.distributed.distributed_c10d.init_process_group",
              "cpu.mooncake_cpu:init_process_group", "AROUND",
              "upstream builds Mooncake WORLD options with a CUDA tensor; CPU builds them on CPU"),
    _cpu_hook("torch.distributed.distributed_c10d.new_group", "cpu.mooncake_cpu:new_group",
              "AROUND", "GroupCoordinator hard-codes backend='mooncake' (CUDA) for device groups"),
    _cpu_hook(f"{S}layers.attention.torch_native_backend.TorchNativeAttnBackend.__init__",
              "cpu.attention:add_cpu_graph_fill_value", "AFTER",
              "DP-attention padding on CPU calls get_cpu_graph_seq_len_fill_value (AMX-only "
              "upstream)"),
    _cpu_hook(f"{S}distributed.parallel_state.GroupCoordinator.reduce_scatterv",
              "cpu.collectives:reduce_scatterv", "AROUND",
              "upstream reduce_scatterv needs pynccl; on CPU all-reduce and keep this rank's "
              "slice"),
    _cpu_hook(f"{S}managers.scheduler_components.dp_attn.exchange_sync_rows",
              "cpu.collectives:exchange_sync_rows", "AROUND",
              "upstream's CPU DP gather of 3+ ranks is a gather and a broadcast; on Mooncake one "
              "all-gather, as on GPU, so a peer's death cannot split the survivors over two"),
    _cpu_hook(f"{S}managers.scheduler.Scheduler.init_idle_sleeper",
              "cpu.idle:install_idle_sleeper", "AFTER",
              "idle ranks poll 50 ms, not 1 s, and park Mooncake's spinning worker meanwhile"),
    _cpu_hook(f"{S}managers.scheduler.Scheduler.init_request_dispatcher",
              "cpu.scheduler_signals:install_scheduler_signals", "AFTER",
              "e2e tests stop one scheduler's main thread with SIGUSR1 (a peer that never "
              "enters the collective) to show what a stall report says; the soak asks for "
              "heap figures with SIGUSR2 (with SGLANG_EEP_HEAP_SNAPSHOT_DIR set)"),
    _cpu_hook(f"{S}managers.scheduler.Scheduler.run_event_loop",
              "cpu.start_up_share:serve_at_normal_share", "BEFORE",
              "a server starts with a heavier CPU share (a joiner beside busy ranks on 2 "
              "cores); its schedulers take the normal share back once they serve"),
    _cpu_hook(f"{S}elastic_ep.elastic_ep._join_world_group",
              "cpu.start_up_share:wait_at_normal_share", "BEFORE",
              "or sooner: a scale joiner waiting for its admission, or a replacement for the "
              "survivors, waits in Mooncake's join_group, its start-up work done"),
    _cpu_hook(f"{S}managers.scheduler.Scheduler.on_idle", "cpu.idle:idle_pass", "AROUND",
              "Mooncake's spinning worker stays parked during idle housekeeping and the poll"),
    _cpu_hook(f"{S}managers.scheduler.Scheduler.run_batch", "cpu.idle:forward_pass", "AROUND",
              "Mooncake's spinning worker stays parked through the forward pass (its MoE "
              "tokens go over NIXL), leaving the core to the schedulers"),
    _cpu_hook(f"{S}model_executor.model_runner.ModelRunner.forward",
              "cpu.slow_pass:dump_stacks_of_a_slow_pass", "AROUND",
              "a pass past 20 s prints every thread's stack from a native watchdog: tells a "
              "rank that was not scheduled from one blocked in a call holding the GIL"),
    _cpu_hook(f"{S}entrypoints.engine._set_envs_and_config", "cpu.child_start:fork_children",
              "AFTER",
              "a server's children fork instead of spawning: no CUDA here, and each spawned "
              "child imported torch and SGLang again, most of a server's start-up on 2 cores"),
    _cpu_hook(f"{S}server_args.wait_port_available", "cpu.shared_host:wait_port_available",
              "AROUND",
              "a node relaunched on node 0's host (CPU cluster) must not wait for node 0's ports"),
    _cpu_hook(f"{S}managers.data_parallel_controller.DataParallelController.event_loop",
              "cpu.idle:dp_controller_event_loop", "REPLACE",
              "upstream's DP controller busy-polls its socket; block in zmq poll until a request"),
    _cpu_hook(f"{S}layers.moe.token_dispatcher.nixl._load_nixl_ep", "cpu.nixl_ep:load_nixl_ep",
              "REPLACE",
              "nixl_ep needs a GPU; the CPU buffer moves host memory over real NIXL"),
    _cpu_hook(f"{S}layers.moe.token_dispatcher.nixl._NixlEPDispatcherImplBase.__init__",
              "cpu.nixl_ep:dispatcher_impl_init", "AROUND",
              "upstream allocates the NIXL mask buffer on 'cuda'; allocate it on CPU"),
    _cpu_hook(f"{S}layers.moe.ep_moe.layer.DeepEPMoE.run_moe_core", "cpu.nixl_ep:run_moe_core",
              "AROUND", "experts compute on the packed low-latency layout NIXL EP delivers"),
    _cpu_hook(f"{S}layers.moe.fused_moe_native.moe_forward_native", "cpu.moe:moe_forward_native",
              "REPLACE",
              "EP on CPU: non-local experts arrive as id -1 and must contribute nothing; 0 tokens "
              "ok"),
)

IMPORT_SHIMS: tuple[ImportShim, ...] = (
    ImportShim("sgl_kernel", "cpu.sgl_kernel_ops:install",
               "the CPU sgl_kernel build is not on PyPI: torch versions of the ops SGLang calls"),
    ImportShim("torchvision", "cpu.torchvision_shim:install",
               "PyPI torchvision is a CUDA build that cannot import beside CPU torch; SGLang "
               "imports it at module level for image models we never serve on CPU"),
    ImportShim("torch.cpu.empty_cache", "cpu.torch_compat:install",
               "EPLB calls torch.<device>.empty_cache, which CPU torch lacks"),
)
