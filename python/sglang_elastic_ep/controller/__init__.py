"""``sglang-eep controller``: the I/O around the pure decisions of ``core.controller``.

``loop`` follows the server (events, status, health, metrics) and carries out the actions;
``launchers`` start and stop joiner processes (local processes or Kubernetes Pods);
``load`` reads the load signal from Prometheus text.
"""
