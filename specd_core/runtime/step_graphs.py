"""CUDA graphs for the lean engine's decode, verify and draft steps.

Why: on a GPU a step of the 8B-shaped target is bound by the host, not the
device (benchmarks/README.md, "One NVIDIA H200"): ~1,250 kernels launched
one by one from Python per verify step, the device busy for 7-19 ms of a
76-129 ms step. A CUDA graph replays every kernel of the layers with one
launch. A graph has fixed shapes and fixed addresses, so a step runs through
one only when its shape falls in a bucket:

* sessions padded up to SESSION_BUCKETS (padding sessions see only the zero
  block's row, their rows' keys and values go to the pool's scratch block,
  specd_core/runtime/paged_kv.py, and their outputs are dropped);
* rows per session padded to the longest session's, at most MAX_ROWS: a
  decode step (1), a verify step of chains or trees, a draft level, also
  of sessions at different depths (the query rows picked and the outputs
  put back by index, as the eager plan does for a group). Prefills, and
  steps whose padding would multiply their rows (PADDED_ROWS_FACTOR), run
  as they are, without a graph;
* key columns rounded up by `key_columns` (at most a quarter more than
  needed), masked past each session's rows: a new graph once per stretch
  of growth, not per token.

The step's plan (specd_core/runtime/lean_step.py) is made as usual, on the
device, then copied into the graph's static inputs; the embeddings before
the layers and the final norm and head after them run outside it. A shape
is captured the second time it is met (the first time it runs eagerly, so
one-off shapes, a batch of short prefills say, cost no capture) and kept,
the least recently used dropped past MAX_GRAPHS; the graphs share one
memory pool.

`SPECD_CUDA_GRAPHS`: auto (the default: on on CUDA, off elsewhere), on, off.
"on" on a CPU runs the same padded static steps without capturing (there is
nothing to replay on a CPU; it is how the tests check that a padded step's
logits are the unpadded step's). A capture that fails (e.g. out of memory)
logs why and turns graphs off for that model; its steps go on without.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.nn.attention import SDPBackend

from specd_core.runtime.lean_step import Group, Step
from specd_core.runtime.paged_kv import SCRATCH_BLOCK

if TYPE_CHECKING:
    from specd_core.runtime.lean import LeanModel

log = logging.getLogger(__name__)

ENV = "SPECD_CUDA_GRAPHS"
SESSION_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MAX_ROWS = 64  # rows per session: a verify tree of up to 63 nodes
# A step runs padded when its padded rows (sessions' bucket x the longest
# session's rows) are at most this many times its real rows, or at most
# FREE_ROWS: on a large GPU a step of a few hundred rows costs little more
# than one of a few (reading the weights dominates), while an eager step
# costs several times its graph (benchmarks/README.md).
PADDED_ROWS_FACTOR = 4
FREE_ROWS = 256
MAX_GRAPHS = 256  # each holds only its static inputs; the memory of its work is one shared pool
MODES = ("auto", "on", "off")
NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def mode_from_env() -> str:
    """`SPECD_CUDA_GRAPHS` (auto, on, off); ValueError naming a bad value."""
    text = os.environ.get(ENV, "").strip().lower() or "auto"
    if text not in MODES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: want one of {', '.join(MODES)}")
    return text


def key_columns(k: int) -> int:
    """The key columns a graph gives a step that needs k: 64 at least, then
    k rounded up to a multiple of a quarter of the largest power of two not
    above it (less than a quarter more than k; four buckets per doubling)."""
    if k <= 64:
        return 64
    q = 1 << (k.bit_length() - 3)
    return -(-k // q) * q


def sessions_bucket(n: int) -> int | None:
    """The padded session count of a step of n sessions (None: more than any bucket)."""
    return next((b for b in SESSION_BUCKETS if b >= n), None)


class Shape(NamedTuple):
    sessions: int
    rows: int
    indexed: bool  # sessions of different row counts: query rows picked by index, outputs put back by index
    keys: tuple[int, ...]  # key columns per window kind
    taps: tuple[int, ...]
    storage: tuple[int, tuple[int, ...]]  # the KV storage's address and shape


class _Static:
    """A graph's inputs and outputs at fixed addresses, and the graph (None: not captured)."""

    def __init__(self, model: LeanModel, shape: Shape, data: torch.Tensor, block_rows: int):
        dev, rows = model.device, shape.sessions * shape.rows
        self.shape = shape
        self.x = torch.zeros(rows, model.embed.shape[1], dtype=model.dtype, device=dev)
        self.rope = [
            tuple(torch.zeros(rows, 1, r.rotary_dim, dtype=model.dtype, device=dev) for _ in range(2))
            for r in model.ropes
        ]
        self.scratch = SCRATCH_BLOCK * block_rows  # the first storage row of the scratch block
        self.write = torch.full((rows,), self.scratch, dtype=torch.long, device=dev)
        self.keys = [torch.zeros(shape.sessions, k, dtype=torch.long, device=dev) for k in shape.keys]
        self.masks = [_pad_mask(shape.sessions, shape.rows, k, model.kv_dtype, dev) for k in shape.keys]
        # Sessions of different row counts: x holds the real rows first, the
        # rest is padding; q_index picks each session's query rows (its last
        # repeated), order puts the outputs back in x's rows. Values past a
        # step's own stay from earlier steps: any index into the buffers is valid.
        self.q_index = torch.zeros(rows, dtype=torch.long, device=dev) if shape.indexed else None
        self.order = torch.zeros(rows, dtype=torch.long, device=dev) if shape.indexed else None
        group = Group(shape.sessions, shape.rows, self.q_index, list(self.keys), list(self.masks), False)
        no_positions = torch.empty(0, dtype=torch.long, device=dev)  # the layers read the RoPE tables only
        self.step = Step([], data, no_positions, self.write, [group], self.order, None)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.tapped: dict[int, torch.Tensor] = {}

    def load(self, step: Step, x: torch.Tensor, rope: list) -> None:
        """Copy a step's inputs in; padding sessions as at the start."""
        n, g = x.shape[0], step.groups[0]
        self.x[:n].copy_(x)
        for (cos, sin), (c, s) in zip(self.rope, rope):
            cos[:n].copy_(c)
            sin[:n].copy_(s)
        self.write[:n].copy_(step.write)
        if n < self.write.shape[0]:
            self.write[n:].fill_(self.scratch)
        if self.q_index is not None and self.order is not None:
            assert isinstance(g.q_index, torch.Tensor) and step.order is not None  # a lone entry's slice: not one group
            self.q_index[: g.q_index.shape[0]].copy_(g.q_index)
            self.order[:n].copy_(step.order)
        for keys, masks, k, m in zip(self.keys, self.masks, g.keys, g.masks):
            assert isinstance(k, torch.Tensor) and m is not None  # StepGraphs.run took only such groups
            keys[: g.size].copy_(k)
            masks[: g.size].copy_(m)
            if g.size < keys.shape[0]:
                keys[g.size :].zero_()
                masks[g.size :].fill_(float("-inf"))
                masks[g.size :, :, :, 0] = 0.0


def _pad_mask(sessions: int, rows: int, keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A padding session's mask: its rows see key column 0 alone (the zero
    block's row), so that no softmax is over nothing."""
    m = torch.full((sessions, 1, rows, keys), float("-inf"), dtype=dtype, device=device)
    m[:, :, :, 0] = 0.0
    return m


class StepGraphs:
    """The graphs of one lean model's bucketed steps (see the module docstring)."""

    def __init__(self, model: LeanModel, capture: bool):
        self.model = model
        self.capture = capture
        self.statics: OrderedDict[Shape, _Static] = OrderedDict()
        self.seen: set[Shape] = set()  # shapes that ran eagerly once: captured when met again
        self.pool: Any = None  # the graphs' shared memory pool, once one is captured
        self.captured = 0
        self.backends: list | None = None  # the attention implementations the captures use, once one succeeded

    def describe(self) -> str:
        """What a replica reports of its graphs (ReplicaInfo.cuda_graphs)."""
        if not self.capture:
            return f"on: padded static steps, no capture on {self.model.device.type}"
        return f"on: {self.captured} shapes captured, {len(self.statics)} kept"

    def takes(self, items: list) -> bool:
        """Whether a forward's items can run as a bucketed step: few enough
        sessions, none with more than MAX_ROWS rows, and the padded step not
        much larger than the real one (every session padded to the longest)."""
        bucket = sessions_bucket(len(items))
        if not items or bucket is None:
            return False
        sizes = [len(it[1]) for it in items]
        return 0 < max(sizes) <= MAX_ROWS and bucket * max(sizes) <= max(PADDED_ROWS_FACTOR * sum(sizes), FREE_ROWS)

    def run(self, step: Step, x: torch.Tensor, rope: list, taps: tuple[int, ...]):
        """The layers' output (R, C) and taps of a planned step through its
        graph, or None when the plan is not one padded group (then the
        caller runs it as it is)."""
        if len(step.groups) != 1:
            return None
        g = step.groups[0]
        keys = [k for k in g.keys if isinstance(k, torch.Tensor)]
        if any(m is None for m in g.masks) or len(keys) < len(g.keys):
            return None
        bucket = sessions_bucket(g.size)
        assert bucket is not None
        indexed = g.q_index is not None
        shape = Shape(bucket, g.rows, indexed, tuple(k.shape[1] for k in keys), taps, _storage(step.data))
        if self.capture and shape not in self.statics and not self._seen_before(shape):
            return None  # a shape met once (a prefill's, say) is not worth a capture yet
        st = self._static(shape, step)
        st.load(step, x, rope)
        if st.graph is None and self.capture:
            self._capture(st)
        if st.graph is not None:
            st.graph.replay()
        else:
            st.out, st.tapped = self.model.run_layers(st.x, st.step, st.rope, taps, self.backends)
        n = x.shape[0]
        assert st.out is not None
        return st.out[:n], {i: t[:n].clone() for i, t in st.tapped.items()}

    def _seen_before(self, shape: Shape) -> bool:
        """Whether a step of this shape ran before (and note that it has now)."""
        if shape in self.seen:
            return True
        if len(self.seen) >= 16 * MAX_GRAPHS:
            self.seen.clear()
        self.seen.add(shape)
        return False

    def _static(self, shape: Shape, step: Step) -> _Static:
        st = self.statics.get(shape)
        if st is None:
            st = _Static(self.model, shape, step.data, step.entries[0].session.block_rows)
            self.statics[shape] = st
            while len(self.statics) > MAX_GRAPHS:
                self.statics.popitem(last=False)
        self.statics.move_to_end(shape)
        return st

    def _capture(self, st: _Static) -> None:
        """Capture the layers over st's buffers: warmed up on a side stream
        first (torch's recipe: lazy initialisations stay out of the graph).
        Where torch's own choice of attention cannot be captured, the graphs
        take the implementations other than cuDNN's. A failure of both turns
        graphs off for this model, logged with its reason."""
        model, taps = self.model, st.shape.taps
        tries = [self.backends] if self.backends is not None else [model.attention_backends, NOT_CUDNN]
        for backends in tries:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    model.run_layers(st.x, st.step, st.rope, taps, backends)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's work on the device (a sampler,
                # a copy) is not an error while this one captures.
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    st.out, st.tapped = model.run_layers(st.x, st.step, st.rope, taps, backends)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                log.warning("capturing a step of %s with attention %s failed: %s", st.shape[:3], backends, exc)
                continue
            self.pool, self.backends = graph.pool(), backends
            st.graph = graph
            self.captured += 1
            return
        log.warning("CUDA graphs off for this model: no capture succeeded")
        model.graphs = None
        self.statics.clear()
        st.out, st.tapped = model.run_layers(st.x, st.step, st.rope, taps)


def describe(model) -> str:
    """A model's graphs as a replica reports them: "off" unless a lean model has them on."""
    graphs = getattr(model, "graphs", None)
    return "off" if graphs is None else graphs.describe()


def _storage(data: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return data.data_ptr(), tuple(data.shape)


def for_model(model: LeanModel, mode: str) -> StepGraphs | None:
    """The model's step graphs under a mode (None: off)."""
    on = mode == "on" or (mode == "auto" and model.device.type == "cuda")
    if not on or not getattr(model, "graphable", True):
        return None
    capture = model.device.type == "cuda"
    how = "captured per shape" if capture else f"padded static steps without capture on {model.device.type}"
    log.info("CUDA graphs (%s=%s): %s", ENV, mode, how)
    return StepGraphs(model, capture)
