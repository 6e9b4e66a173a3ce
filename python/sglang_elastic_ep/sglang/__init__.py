"""Adapters that hook into SGLang 0.5.23 (imported only inside SGLang processes)."""
