"""Target hidden states (EAGLE features) as compact bytes on the wire.

The verifier computes the features anyway (the last decoder layer's output,
before the final norm); sending them costs rows x hidden x 2 bytes (fp16 or
bf16: half of fp32, and the head was trained on fp32 features, which fp16
rounds to ~1e-3 relative). The orchestrator only concatenates bytes - it never
decodes them - and forwards them to the drafter with the next Propose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class HiddenStates:
    data: bytes  # (rows, hidden_size) row-major, little-endian
    rows: int
    hidden_size: int
    dtype: str = "float16"

    @classmethod
    def encode(cls, t: torch.Tensor, dtype: str = "float16") -> HiddenStates:
        """(rows, C) tensor -> bytes. bf16 goes through its int16 bit pattern
        (numpy has no bfloat16)."""
        half = t.detach().to("cpu", DTYPES[dtype]).contiguous()
        raw = half.view(torch.int16).numpy() if dtype == "bfloat16" else half.numpy()
        return cls(raw.astype(raw.dtype.newbyteorder("<"), copy=False).tobytes(), t.shape[0], t.shape[1], dtype)

    def decode(self) -> torch.Tensor:
        """bytes -> (rows, C) float32 tensor; raises ValueError on a bad payload."""
        if self.dtype not in DTYPES:
            raise ValueError(f"hidden_states.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.rows < 0 or self.hidden_size <= 0 or len(self.data) != 2 * self.rows * self.hidden_size:
            raise ValueError(
                f"hidden_states: {len(self.data)} bytes do not hold {self.rows} x {self.hidden_size} 2-byte values"
            )
        raw = np.frombuffer(self.data, dtype="<f2" if self.dtype == "float16" else "<i2")
        t = torch.from_numpy(raw.copy()).view(self.rows, self.hidden_size)
        return (t if self.dtype == "float16" else t.view(torch.bfloat16)).float()

    @staticmethod
    def concat(parts: list[HiddenStates]) -> HiddenStates | None:
        """Consecutive rows from several messages (bytes only, no decoding)."""
        parts = [p for p in parts if p is not None and p.rows]
        if not parts:
            return None
        if len({(p.hidden_size, p.dtype) for p in parts}) > 1:
            raise ValueError("hidden states of different widths or dtypes cannot be joined")
        return HiddenStates(
            b"".join(p.data for p in parts), sum(p.rows for p in parts), parts[0].hidden_size, parts[0].dtype
        )
