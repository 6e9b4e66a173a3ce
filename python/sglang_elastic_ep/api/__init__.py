"""HTTP adapters of the orchestrator contract: routes, control plane, webhook, metrics.

Importing this package loads FastAPI and httpx but neither SGLang nor prometheus_client
(``metrics`` imports it lazily; see its docstring). See docs/api.md.
"""
