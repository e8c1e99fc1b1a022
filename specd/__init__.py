"""specd shared core: sampling and acceptance rules, model loading, errors, gRPC helpers.

Nothing in the pure modules (sampling, acceptance, models) imports grpc, so the
rules are testable as plain functions on tensors.
"""
__version__ = "0.1.0"
