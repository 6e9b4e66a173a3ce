"""Local CPU cluster harness: real SGLang server processes, used by tests, benchmarks, the demo."""

from sglang_elastic_ep_testbed.cluster.launcher import ClusterSpec, LocalCluster, ServerProcess
from sglang_elastic_ep_testbed.cluster.load import LoadClient, RequestResult

__all__ = ["ClusterSpec", "LocalCluster", "LoadClient", "RequestResult", "ServerProcess"]
