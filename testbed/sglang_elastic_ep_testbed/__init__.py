"""CPU testbed of sglang-elastic-ep: engine shims, the CPU NIXL EP buffer, the cluster
harness, the tiny model, and ``sglang-eep testbed``."""
