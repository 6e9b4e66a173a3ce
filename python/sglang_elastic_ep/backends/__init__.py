"""Data-plane backends of the elastic EP plugin, importable without SGLang.

``nixl_membership`` decides when the NIXL EP buffer connects and disconnects ranks (the same code
drives the real ``nixl_ep.Buffer`` and any buffer with its interface); ``active_ranks_mirror``
keeps a host-side copy of the active-rank mask so the per-forward poll never syncs with the GPU.
"""
