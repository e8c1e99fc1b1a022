"""A projection's weight in the layout its device multiplies fastest.

On a CPU in float32, MKL multiplies a small weight stored transposed, (in,
out) contiguous, faster than `F.linear` on the (out, in) weight at the row
counts of decode and verify steps, and a large one slower once the rows grow.
Measured on a 2-core x86 VM, one thread, microseconds F.linear / transposed:

| weight (out x in) | 8 rows | 40 rows | 160 rows |
|---|---|---|---|
| 1,376 x 256 | 54 / 30 | 173 / 135 | (320 rows: 1,094 / 1,058) |
| 4,096 x 256 (an LM head) | 440 / 183 | 616 / 491 | (320: 3,218 / 3,170) |
| 1,536 x 512 | 292 / 121 | 421 / 334 | 1,315 / 1,240 |
| 2,048 x 2,048 | 1,777 / 775 | 2,618 / 2,464 | 7,172 / 10,573 |
| 6,144 x 2,048 | 5,332 / 2,302 | 8,055 / 7,742 | 21,503 / 30,059 |

So a weight of at most TRANSPOSE_MAX_ELEMENTS is stored transposed there
(a fixed rule, not a timing at load: the layout decides the last bits of
every product, and a deployment must compute the same thing every time it
starts). bfloat16 on the same CPU goes the other way (AMX kernels take the
(out, in) weight), and on CUDA cuBLAS takes either at no cost, so everywhere
else the weight stays as the checkpoint has it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# 2 Mi elements (8 MiB in float32): every weight of the table's faster rows,
# none of its slower ones.
TRANSPOSE_MAX_ELEMENTS = 2 * 1024 * 1024


def transposed_is_faster(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() <= TRANSPOSE_MAX_ELEMENTS


class Dense:
    """y = x W^T + b for x (R, in); `weight` (out, in) as a checkpoint has it,
    kept as given or stored transposed (transposed_is_faster). `weight`
    gives the (out, in) weight either way (a view of the transposed storage),
    so whoever shares the tensor can point at it instead of a second copy."""

    __slots__ = ("bias", "t", "w")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias
        self.t = transposed_is_faster(weight)
        self.w = weight.t().contiguous() if self.t else weight  # (in, out) | (out, in)

    @property
    def weight(self) -> torch.Tensor:
        return self.w.t() if self.t else self.w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.t:
            return F.linear(x, self.w, self.bias)
        if self.bias is None:
            return torch.matmul(x, self.w)
        return torch.addmm(self.bias, x, self.w) if x.dim() == 2 else torch.matmul(x, self.w) + self.bias
