"""Utilities for the package's own tests and benchmarks, not for training runs: a
``vllm serve`` launcher (``vllm_server.VLLMServer``)."""
