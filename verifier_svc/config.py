from __future__ import annotations

from dataclasses import dataclass, field

from specd_core.net.flags import flag, not_flag
from specd_core.net.service_config import MAX_SESSIONS_HELP, PORT_HELP, ModelServiceConfig


@dataclass(frozen=True)
class VerifierConfig(ModelServiceConfig):
    """The verifier service's settings: the model service's (model_dir is the
    target, an HF causal LM directory) and its own. Each field's metadata is
    its `python -m verifier_svc` flag (specd_core/net/flags.py)."""

    port: int = field(default=50061, metadata=flag(PORT_HELP))
    max_sessions: int = field(default=256, metadata=flag(MAX_SESSIONS_HELP))
    # Dtype of the hidden states (EAGLE features) sent to sessions that ask:
    # float16 | bfloat16 (2 bytes per value either way).
    hidden_dtype: str = field(default="float16", metadata=not_flag("fixed: the features' wire dtype"))
    # Plain decoding's next forward runs as soon as a batch is answered and no
    # call waits, before the sessions' calls arrive (verifier_svc/ahead.py).
    decode_ahead: bool = field(
        default=True,
        metadata=flag(
            "run plain (K = 0) sessions' next forward when their calls arrive, not as soon as the verifier is idle",
            name="--no-decode-ahead",
        ),
    )
