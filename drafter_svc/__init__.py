"""Drafter service: hosts the small model, proposes K draft tokens per call."""
