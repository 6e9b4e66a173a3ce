"""Elastic expert parallelism for SGLang."""
