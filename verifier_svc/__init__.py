"""Verifier service: hosts the target model and owns every session's KV cache."""
