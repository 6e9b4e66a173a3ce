"""GPU kernels of the elastic EP plugin (importable without SGLang; Triton is imported lazily).

``select_physical_experts`` maps top-k logical expert ids to physical replicas that live on
active ranks, with a per-token flag for tokens that lost an expert entirely. It runs a Triton
kernel on CUDA tensors and the torch reference (``select_physical_experts_reference``) elsewhere.
"""

from .expert_select import build_replica_table, select_physical_experts, triton_available
from .expert_select_reference import select_physical_experts_reference, token_hash

__all__ = [
    "build_replica_table",
    "select_physical_experts",
    "select_physical_experts_reference",
    "token_hash",
    "triton_available",
]
