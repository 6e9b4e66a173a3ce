"""``sglang-eep``: command-line client of the elastic EP API (see docs/api.md)."""
