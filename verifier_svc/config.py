from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifierConfig:
    model_dir: str                   # HF causal LM directory (the target)
    host: str = "0.0.0.0"            # where the gRPC server listens
    port: int = 50061                # 0 = pick a free port
    device: str = "auto"             # auto | cpu | cuda | cuda:N
    dtype: str = "float32"           # float32 | float16 | bfloat16
    max_draft_tokens: int = 16       # draft depth limit per verify call (K for a chain)
    max_tree_nodes: int = 64         # draft tree size limit per verify call
    max_sessions: int = 256          # open sessions at once; past it: RESOURCE_EXHAUSTED
    max_kv_tokens: int = 1_000_000   # sum of cached tokens over sessions
    engine: str = "auto"             # auto (lean forward where supported) | lean | hf
    torch_threads: int = 0           # 0 = torch default
    grpc_workers: int = 8
    # Verify calls of concurrent sessions share one forward (lean engine; the HF
    # engine runs a batch's calls one after another), up to this many sessions.
    # 1 = one session per forward.
    max_batch_sessions: int = 32
    # Dtype of the hidden states (EAGLE features) sent to sessions that ask:
    # float16 | bfloat16 (2 bytes per value either way).
    hidden_dtype: str = "float16"
