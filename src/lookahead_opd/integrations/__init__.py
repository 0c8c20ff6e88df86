"""Integrations of lookahead-opd with Hugging Face, vLLM and an on-policy distillation loop.

Each submodule imports its heavy dependencies itself, so importing this package is cheap.
"""
