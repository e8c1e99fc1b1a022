"""One forward step of the lean engine (specd_core/runtime/lean.py) over
every session at once: where each new row is written in the paged cache
(specd_core/runtime/paged_kv.py), its RoPE position, and how the rows attend.

Attention runs over a padded batch: each session an entry of `rows` query
rows (its own, the padding repeating its last one) and K key columns, the
keys gathered from the session's blocks by one index per layer; columns past
a session's rows read the zero block and are masked. The additive masks
(causal, sliding window, token trees, a caller's dense mask placed into its
entry) are built once per step and window size, on the device, and serve
every layer.

Sessions of very different sizes would pad each other out (a 2000-row
prefill beside 5-row verifies, a long context beside short ones), so
entries are grouped: a session joins the group while the group's padded
area (entries x rows x keys) stays within SPREAD times its real area plus
SLACK; each group is one attention call per layer. A step of sessions of
about one size, which a decode or verify step is, is one group.

Token trees (an item whose mask is a `TokenTree`: its rows are the root,
then the nodes) cost no operator per session: their positions (start +
depth) are host integers of the pack, and their mask is the causal one less
the (row, key) pairs it shows a node that are not its ancestors - earlier
siblings and their subtrees - listed in the pack and cleared in one indexed
write per group and window size. A tree's pairs depend on its shape alone
and are computed once per shape. One level of a tree growing on a drafter
(a `TreeLevel`: nodes of one depth, each seeing the committed rows, its
ancestors' cached rows and itself) goes the same way: its positions are
host integers and the rows it hides (other nodes' rows, the level's earlier
rows) are pairs of the pack.

On a CPU a session whose keys lie in one range of storage (the pool places
blocks in runs) and are long enough is read in place instead, a group of
its own (in_place): the gather is a copy of every key row per layer, bound by
memory bandwidth, and past IN_PLACE_BYTES it costs more than a call. A lone
entry's causal mask over the end of its keys is a view of one cached tensor
(tail_mask).

Key buckets (`SPECD_KEY_BUCKET`, off by default): each group's key columns
rounded up to a multiple of the bucket, the columns past a session's rows
masked like a group's padding, and a lone session taking the masked path
too: a step's shapes then change once per bucket of growth instead of at
every token, for implementations that prepare per shape (cuDNN's attention
plans; CUDA graphs capture one shape each). The logits are those of the
exact shapes up to the rounding of a longer masked sum.

Host -> device: one int64 tensor per step (every index below, the callers'
position tensors appended) and one tensor of callers' dense masks per group
that has them (the drafter's branches); nothing is read back.

Sliding windows: a key is attended when the query's position minus its
position is below the window (Hugging Face's rule). Positions are not stored
per cache row; instead a row attends to the last `window` keys that its mask
lets it see. The rows a mask shows a query (the committed sequence, then its
tree ancestors, then itself) are its own sequence, at consecutive positions -
so the last `window` of them are exactly the keys within the window, trees
included. A causal entry's keys start at its first row's window.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from specd_core.rules.tree import TokenTree
from specd_core.runtime.tree_tensors import TreeLevel

if TYPE_CHECKING:
    from specd_core.runtime.paged_kv import LeanSession

SPREAD = 2  # a group's padded attention area may be this many times its real area ...
SLACK = 1 << 15  # ... plus this many (row, key) pairs
# A session's keys of one layer from this many bytes on are read in place on a
# CPU (in_place). One thread of a 2-core x86 VM, float32, per layer, 8 sessions
# of 1 / 5 query rows: keys of 2 KiB rows (4 KV heads of 64) x 200 each,
# gathered and one call 427 / 522 us, a call each in place 274 / 380 us; x 400:
# 804 / 971 against 429 / 622; 1 KiB rows x 200: 198 / 241 against 200 / 255
# (even), 4 sessions x 200: 75 / 96 against 101 / 126 (the gather wins).
IN_PLACE_BYTES = 256 * 1024


class Entry(NamedTuple):
    """One item of a step: its session's rows [start, end), at x rows [r0, r0 + n)."""

    session: LeanSession
    n: int
    start: int
    r0: int
    positions: torch.Tensor | None  # (n,) RoPE positions; None: start..end-1, or the tree's
    mask: torch.Tensor | None  # (n, end) additive, a caller's; None: causal, or the tree's
    tree: TokenTree | TreeLevel | None  # the rows are [root, node0 ..] of this tree, or this level of one

    @property
    def masked(self) -> bool:
        """Whether its mask is not the causal one (a caller's, or a tree's)."""
        return self.mask is not None or self.tree is not None

    @property
    def end(self) -> int:
        return self.start + self.n


class Group(NamedTuple):
    """Entries that attend in one call per layer."""

    size: int
    rows: int  # query rows per entry
    # (size * rows,) the x row of each query (a lone entry's: a slice of x); None: x as it is
    q_index: torch.Tensor | slice | None
    keys: list[torch.Tensor | range]  # per window kind: (size, K) storage rows of the keys, or their range
    masks: list[torch.Tensor | None]  # per kind: additive (size, 1, rows, K); None: `causal` says
    causal: bool  # no mask: causal (a lone prefill) or not (a lone decode row)
    # Query heads per KV head that ride as query rows (1: none): each KV
    # head's queries then read its keys in one block of fold * rows rows, and
    # the masks are (size, 1, fold * rows, K), head-major (fold_heads).
    fold: int = 1


class Step(NamedTuple):
    entries: list[Entry]
    data: torch.Tensor  # the sessions' storage (paged_kv.PagedKV.data)
    positions: torch.Tensor  # (R,) RoPE position of each row
    write: torch.Tensor  # (R,) storage row each new row's K and V go to
    groups: list[Group]
    order: torch.Tensor | None  # (R,) each row's place in the groups' padded outputs; None: in place
    keep: torch.Tensor | None  # the rows whose logits are wanted; None: all


class _Pack:
    """Integers for the device, gathered on the host and uploaded as one tensor."""

    def __init__(self):
        self.ints: list[int] = []
        self.tensors: list[torch.Tensor] = []  # CPU int tensors appended after the ints
        self.data = torch.empty(0, dtype=torch.long)

    def put(self, values) -> slice:
        a = len(self.ints)
        self.ints.extend(values)
        return slice(a, len(self.ints))

    def upload(self, device: torch.device) -> None:
        data = torch.tensor(self.ints, dtype=torch.long)
        if self.tensors:
            data = torch.cat([data, *self.tensors])
        self.data = data.to(device)

    def __getitem__(self, where: slice) -> torch.Tensor:
        return self.data[where]


def entries_of(items: list) -> list[Entry]:
    """Each item's entry, its session's rows reserved now (CapacityExceeded
    from the pool for a session that cannot have them). An item's mask is
    an additive tensor, a TokenTree or a TreeLevel (then its positions are
    the tree's or the level's)."""
    entries, r0 = [], 0
    for s, token_ids, positions, mask in items:
        n, start = len(token_ids), s.length
        tree = mask if isinstance(mask, (TokenTree, TreeLevel)) else None
        rows = len(tree.tokens) + 1 if isinstance(tree, TokenTree) else len(tree.positions) if tree else n
        if tree is not None and (positions is not None or n != rows):
            raise ValueError(f"this {type(tree).__name__} takes {rows} rows and no positions, not {n}")
        s.reserve(start + n)
        entries.append(Entry(s, n, start, r0, positions, None if tree is not None else mask, tree))
        r0 += n
    return entries


class TreeLayout(NamedTuple):
    """What a tree's rows need of the step beside the causal mask."""

    depths: tuple[int, ...]  # per row; the root's is 0
    hidden: tuple[tuple[int, int], ...]  # (row, earlier row) pairs where the earlier is not an ancestor


@functools.lru_cache(maxsize=256)
def tree_layout(parents: tuple[int, ...]) -> TreeLayout:
    """The layout of the rows [root, node0 ..] of a tree with these parents
    (cached: drafts of one shape share it)."""
    depths, seen, hidden = [0], [{0}], []
    for i, a in enumerate(parents):
        row = i + 1
        depths.append(depths[a + 1] + 1)
        seen.append(seen[a + 1] | {row})
        hidden += [(row, c) for c in range(1, row) if c not in seen[row]]
    return TreeLayout(tuple(depths), tuple(hidden))


def _host_positions(e: Entry) -> Sequence[int]:
    """An entry's RoPE positions when the host knows them (no caller's tensor)."""
    if e.tree is None:
        return range(e.start, e.end)
    if isinstance(e.tree, TreeLevel):
        return e.tree.positions
    return [e.start + d for d in tree_layout(e.tree.parents).depths]


def group_entries(entries: list[Entry], alone: Sequence[int] = ()) -> list[list[int]]:
    """Indices of the entries of each group (see the module docstring), each
    in item order; the entries `alone` (in_place) a group each."""
    groups: list[list[int]] = [[i] for i in alone]
    rest = sorted(set(range(len(entries))) - set(alone), key=lambda i: -entries[i].end)
    if not rest:
        return groups
    cur: list[int] = []
    rows = keys = real = 0
    for i in rest:
        e = entries[i]
        r, k, a = max(rows, e.n), max(keys, e.end), real + e.n * e.end
        if cur and (len(cur) + 1) * r * k > SPREAD * a + SLACK:
            groups.append(sorted(cur))
            cur, r, k, a = [], e.n, e.end, e.n * e.end
        cur.append(i)
        rows, keys, real = r, k, a
    groups.append(sorted(cur))
    return groups


def in_place(model, entries: list[Entry]) -> list[int]:
    """On a CPU, the entries of a batch whose keys attention reads in place:
    their rows lie in one range of storage (the pool places a session's
    blocks in runs) and are at least IN_PLACE_BYTES per layer. Each is then
    a group of its own, one attention call per layer reading its rows where
    they are, instead of a part of the gathered copy that a group's call
    reads: the gather is a copy of every key row per layer, bound by memory
    bandwidth, which costs more than a call's overhead for long rows. On
    CUDA every entry stays in the batched groups (one call per layer
    whatever the sessions; a launch costs more there than a copy)."""
    if len(entries) < 2 or model.device.type != "cpu":
        return []
    row = 2 * model.n_kv * model.head_dim * model.kv_dtype.itemsize
    out = []
    for i, e in enumerate(entries):
        k0 = min(_k0(e, w) for w in model.windows)
        if (e.end - k0) * row >= IN_PLACE_BYTES and e.session.in_one_run(k0):
            out.append(i)
    return out


def _positions(pack: _Pack, entries: list[Entry]) -> tuple[slice, bool]:
    """Where the rows' RoPE positions are in the pack, and whether that is
    an index into the pack instead (callers' position tensors, which follow
    the ints: so this puts the last ints)."""
    if all(e.positions is None for e in entries):
        return pack.put(p for e in entries for p in _host_positions(e)), False
    after = len(pack.ints) + sum(e.n for e in entries)  # where `defaults` will start; tensors follow them
    defaults: list[int] = [p for e in entries if e.positions is None for p in _host_positions(e)]
    index: list[int] = []
    d, t = after, after + len(defaults)
    for e in entries:
        if e.positions is None:
            index.extend(range(d, d + e.n))
            d += e.n
        else:
            index.extend(range(t, t + e.n))
            pack.tensors.append(e.positions.to("cpu", torch.long).reshape(-1))
            t += e.n
    at = pack.put(index)
    pack.put(defaults)
    return at, True


class _Spec(NamedTuple):
    """A group's fields in the pack, and what the host knows of its shape."""

    members: list[int]
    rows: int
    block_rows: int
    q_index: slice | None  # where the pack lists the query rows; q_rows: a lone entry's, in x
    q_rows: slice | None
    table: slice
    width: int  # blocks per table row
    start: slice
    n: slice
    end: slice
    k0: list[slice]  # per window kind
    keys: list[int]  # per kind: key columns
    slots: list[slice | range] | None  # per kind: a lone entry's key rows (a range: contiguous)
    trees: slice | None  # the places in the group of members with a caller's mask
    hidden: list[slice] | None  # per window kind: the pairs its token trees hide (_hidden)
    masked_end: int  # the largest end of members with a caller's mask or a tree (0: none)
    causal: bool | None  # None: masks; else the lone entry's is_causal
    tail: bool  # a lone entry's mask is the causal one of its last rows (tail_mask on a CPU), every window kind


def _lone(e: Entry, windows: list[int | None], softcap: bool) -> bool | None:
    """A group of this one entry without a mask: None (it needs masks), or
    whether SDPA's is_causal does it (a prefill; a decode row sees every key)."""
    if softcap or e.masked:  # the soft-capped path takes masks only
        return None
    if e.n == 1:  # its keys start at its window: it sees them all
        return False
    return True if e.start == 0 and all(w is None or w >= e.end for w in windows) else None


def _k0(e: Entry, w: int | None) -> int:
    """The first key row an entry's queries may see in a layer of window w."""
    if e.masked or w is None or w >= e.end:
        return 0
    return max(0, e.start - w + 1)


KeyRounding = Callable[[int], int]  # a group's key columns -> the columns it is given


def round_to(bucket: int) -> KeyRounding | None:
    """Key columns rounded up to a multiple of `bucket` (None: exact, for 0 or 1)."""
    return None if bucket <= 1 else lambda k: -(-k // bucket) * bucket


def _spec(
    pack: _Pack,
    entries: list[Entry],
    members: list[int],
    windows: list[int | None],
    softcap: bool,
    round_keys: KeyRounding | None,
) -> _Spec:
    es = [entries[i] for i in members]
    rows = max(e.n for e in es)
    q_index = q_rows = None
    if len(es) == 1 and len(entries) > 1:
        q_rows = slice(es[0].r0, es[0].r0 + rows)  # a view of x, not an index
    elif len(es) < len(entries) or any(e.n != rows for e in es):
        q_index = pack.put(e.r0 + min(r, e.n - 1) for e in es for r in range(rows))
    k0s = [[_k0(e, w) for e in es] for w in windows]
    keys = [max(e.end - k for e, k in zip(es, ks)) for ks in k0s]
    if round_keys is not None:  # key columns rounded up (masked past each entry's rows): fewer distinct shapes
        keys = [round_keys(k) for k in keys]
    lone = len(es) == 1 and round_keys is None  # a lone entry's exact keys; a rounded one takes the masked path
    b = es[0].session.block_rows
    width = max(-(-(k + ks[j]) // b) for k, ks in zip(keys, k0s) for j in range(len(es)))
    table = pack.put(t for e in es for t in (e.session.table[:width] + [0] * (width - len(e.session.table))))
    causal = _lone(es[0], windows, softcap) if lone else None
    return _Spec(
        members,
        rows,
        b,
        q_index,
        q_rows,
        table,
        width,
        pack.put(e.start for e in es),
        pack.put(e.n for e in es),
        pack.put(e.end for e in es),
        [pack.put(ks) for ks in k0s],
        keys,
        # One session: its key rows are a short list (fewer operators than computing them).
        [_lone_keys(pack, es[0], ks[0]) for ks in k0s] if lone else None,
        pack.put(j for j, e in enumerate(es) if e.mask is not None) if any(e.mask is not None for e in es) else None,
        _hidden(pack, es, rows, keys),
        max((e.end for e in es if e.masked), default=0),
        causal,
        lone and causal is None and not es[0].masked and all(w is None or w >= es[0].end for w in windows),
    )


def _hidden(pack: _Pack, es: list[Entry], rows: int, keys: list[int]) -> list[slice] | None:
    """Per window kind, where the pack lists the pairs the members' trees
    and tree levels hide, as flat indices into the group's (size, rows, K)
    mask (their keys start at column 0: their k0)."""
    pairs = [(j * rows + r, c) for j, e in enumerate(es) if e.tree is not None for r, c in _hides(e)]
    if not pairs:
        return None
    return [pack.put(q * k + c for q, c in pairs) for k in keys]


def _hides(e: Entry) -> list[tuple[int, int]]:
    """The (row, cache row) pairs of a tree's or a level's entry that the causal mask shows and it does not."""
    if isinstance(e.tree, TreeLevel):
        return e.tree.hidden(e.start)
    assert e.tree is not None
    return [(r, e.start + c) for r, c in tree_layout(e.tree.parents).hidden]


def _lone_keys(pack: _Pack, e: Entry, k0: int) -> slice | range:
    """A lone entry's key rows: where they are listed in the pack, or the
    storage range they fill when its blocks from k0 on are consecutive (the
    usual case: a session takes its blocks in runs), which attention then
    reads in place."""
    s, b = e.session, e.session.block_rows
    blocks = s.table[k0 // b : (e.end - 1) // b + 1]
    if all(y == x + 1 for x, y in zip(blocks, blocks[1:])):
        first = s.slot(k0)
        return range(first, first + e.end - k0)
    return pack.put(s.slots(k0, e.end))


def plan(
    model, items: list, last_only: bool | list[bool], round_keys: KeyRounding | None = None, fold: bool = True
) -> Step:
    """The step of a forward_batch's items (see the module docstring); its
    key columns rounded by `round_keys`, else by the model's key bucket;
    fold: query heads ride as rows where fold_heads says (False: never)."""
    entries = entries_of(items)
    if len({id(e.session.store) for e in entries}) > 1:
        raise ValueError("the sessions of one forward must share a KV pool")
    pack = _Pack()
    write = pack.put(s for e in entries for s in e.session.slots(e.start, e.end))
    softcap, rounding = model.softcap is not None, round_keys or round_to(model.key_bucket)
    alone = in_place(model, entries) if rounding is None else []
    specs = [_spec(pack, entries, m, model.windows, softcap, rounding) for m in group_entries(entries, alone)]
    order = _order(pack, entries, specs)
    keep = _keep(pack, entries, last_only)
    at, indexed = _positions(pack, entries)  # last: the tensors it appends follow every int
    dense = [_dense(entries, s, model.kv_dtype) for s in specs]
    pack.upload(model.device)
    positions = pack.data[pack[at]] if indexed else pack[at]
    ar = torch.arange(max(max(s.rows, *s.keys) for s in specs), device=model.device)
    heads = fold_heads(model) if fold else 1
    groups = [_group(model, pack, s, t, ar, heads) for s, t in zip(specs, dense)]
    return Step(
        entries,
        entries[0].session.store.data,
        positions,
        pack[write],
        groups,
        None if order is None else pack[order],
        None if keep is None else pack[keep],
    )


def _dense(entries: list[Entry], s: _Spec, kvt: torch.dtype) -> torch.Tensor | None:
    """The callers' dense masks of a group's members, (masks, rows, widest), on the
    host: -inf past each one's rows and columns, but column 0 open on its
    padding rows (a query row that sees nothing would be NaN)."""
    es = [entries[i] for i in s.members if entries[i].mask is not None]
    if not es:
        return None
    out = torch.full((len(es), s.rows, max(e.end for e in es)), float("-inf"), dtype=kvt)
    out[:, :, 0] = 0.0
    for t, e in enumerate(es):
        assert e.mask is not None
        out[t, : e.n, : e.end] = e.mask
    return out


class _Shown(NamedTuple):
    """What a group's masks change of the causal one (on the device)."""

    placed: tuple[torch.Tensor, torch.Tensor] | None  # (places, callers' masks) put in from key 0
    hidden: torch.Tensor | None  # the pairs the trees hide, flat indices into (size, rows, K)
    end: int  # the largest end of an entry with either (0: none)


def _group(model, pack: _Pack, s: _Spec, trees: torch.Tensor | None, ar: torch.Tensor, heads: int) -> Group:
    """A group's key rows and masks per window kind, on the device; its
    query heads folded into rows by `heads` (not a causal lone entry's,
    whose mask SDPA's is_causal makes)."""
    size, b = len(s.members), s.block_rows
    # On a CPU only: elsewhere an offset view may not meet a kernel's alignment for masks.
    tail = s.tail and model.device.type == "cpu"
    q_row = None
    if s.causal is None and not tail:  # each query's own cache row; padding rows repeat their entry's last
        r = ar[: s.rows][None] if s.q_index is None else torch.minimum(ar[: s.rows][None], pack[s.n][:, None] - 1)
        q_row = (pack[s.start][:, None] + r)[:, :, None]
    placed = None if trees is None or s.trees is None else (pack[s.trees], trees.to(model.device))
    keys: list[torch.Tensor | range] = []
    masks: list[torch.Tensor | None] = []
    for kind, w in enumerate(model.windows):
        key_row = None
        if s.slots is not None:
            at = s.slots[kind]
            keys.append(pack[at][None] if isinstance(at, slice) else at)
        else:
            key_row = pack[s.k0[kind]][:, None] + ar[: s.keys[kind]][None]  # (size, K)
            slot = pack[s.table].view(size, s.width).gather(1, key_row // b) * b + key_row % b
            keys.append(torch.where(key_row < pack[s.end][:, None], slot, 0))  # past its rows: the zero block
        if tail:
            masks.append(tail_mask(s.rows, s.keys[kind], model.kv_dtype, model.device))
            continue
        if q_row is None:
            masks.append(None)
            continue
        if key_row is None:
            key_row = pack[s.k0[kind]][:, None] + ar[: s.keys[kind]][None]
        shown = _Shown(placed, None if s.hidden is None else pack[s.hidden[kind]], s.masked_end)
        masks.append(_mask(key_row, q_row, w, shown, model.kv_dtype))
    q_index = s.q_rows if s.q_index is None else pack[s.q_index]
    if heads == 1 or s.causal:
        return Group(size, s.rows, q_index, keys, masks, bool(s.causal))
    # Repeated once here for every layer; a row's mask (rows == 1) broadcasts as it is.
    masks = [m if m is None or s.rows == 1 else m.repeat(1, 1, heads, 1) for m in masks]
    return Group(size, s.rows, q_index, keys, masks, False, heads)


def fold_heads(model) -> int:
    """How many query heads per KV head a step's groups fold into query rows
    on this model: all of them (n_heads / n_kv) on a CPU, 1 elsewhere and
    for the soft-capped path (model.fold_mode, SPECD_FOLD_HEADS: auto; on:
    on every device; off: nowhere).

    SDPA's grouped-query call gives each query head its own block of `rows`
    query rows; folded, a KV head's query heads form one block of
    heads * rows rows over the same keys: the same products in one kernel
    block per KV head instead of one per query head (the layout Hugging
    Face's repeat_kv implies, and FlashAttention's "pack GQA" on GPUs). A
    whole step's attention, every layer, one CPU thread, float32, 32 query /
    8 KV heads of 8 (python -m benchmarks.attention on benchmarks/engine.py's
    target, grouped / folded): 64 decode rows over 130 keys 85.5 / 49.2 ms,
    64 x 5 verify rows 105.2 / 89.5, 8 x 5 over 300 keys 30.4 / 26.6, one
    decode row 2.24 / 1.35. The outputs agree to float32 rounding (a one-row call of the
    grouped form takes another kernel path than the folded one). Not on
    CUDA: its kernels there have not been measured folded, and CUDA graphs
    capture the unfolded call.
    """
    mode = model.fold_mode
    if model.softcap is not None or mode == "off" or (mode == "auto" and model.device.type != "cpu"):
        return 1
    return model.n_heads // model.n_kv


_TAILS: dict[tuple, torch.Tensor] = {}


def tail_mask(rows: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask (1, 1, rows, keys) of `rows` queries at the last
    `rows` of `keys` consecutive key rows, each seeing the keys up to its
    own (causal, aligned at the bottom right, which SDPA's is_causal is
    not): a view of one tensor per (rows, dtype, device), widened as keys
    grow, so that a lone entry's mask costs no operator."""
    at = (rows, dtype, device)
    t = _TAILS.get(at)
    if t is None or t.shape[-1] < keys:
        width = max(keys, 2 * t.shape[-1] if t is not None else 1024)
        t = torch.zeros(1, 1, rows, width, dtype=dtype, device=device)
        col = torch.arange(width, device=device)[None]
        t[0, 0].masked_fill_(col > width - rows + torch.arange(rows, device=device)[:, None], float("-inf"))
        _TAILS[at] = t
    return t[..., t.shape[-1] - keys :]


def _mask(key_row: torch.Tensor, q_row: torch.Tensor, w: int | None, shown: _Shown, kvt: torch.dtype) -> torch.Tensor:
    """Additive (size, 1, rows, K): causal within the window, less the pairs
    the trees hide, the callers' masks placed into their entries (keys from
    row 0), and cut to the window."""
    key_row = key_row[:, None]  # (size, 1, K) against q_row (size, rows, 1)
    seen = key_row <= q_row
    # A tree row's cache row is not its position, nor a caller's row's: where
    # the window is shorter than such an entry, it is cut by count below
    # (exact for the causal rows too: each sees its own consecutive keys).
    by_count = w if w is not None and w < shown.end else None
    if w is not None and by_count is None:
        seen &= key_row > q_row - w
    if shown.hidden is not None:
        seen.view(-1).index_fill_(0, shown.hidden, False)
    mask = torch.zeros(seen.shape, dtype=kvt, device=seen.device).masked_fill_(~seen, float("-inf"))
    if shown.placed is not None:
        at, trees = shown.placed
        mask[at, :, : trees.shape[-1]] = trees
    if by_count is not None:
        # A row sees its past and ancestors, its own sequence: keep the last `w` of them.
        later = (mask > torch.finfo(kvt).min / 2).flip(-1).cumsum(-1).flip(-1)
        mask.masked_fill_(later > by_count, float("-inf"))
    return mask[:, None]


def _order(pack: _Pack, entries: list[Entry], specs: list[_Spec]) -> slice | None:
    """Each row's place in the concatenated padded outputs, None when that is its own."""
    if len(specs) == 1 and specs[0].q_index is None:
        return None
    place: dict[int, int] = {}
    offset = 0
    for s in specs:
        for j, i in enumerate(s.members):
            place[i] = offset + j * s.rows
        offset += len(s.members) * s.rows
    return pack.put(place[i] + r for i, e in enumerate(entries) for r in range(e.n))


def _keep(pack: _Pack, entries: list[Entry], last_only: bool | list[bool]) -> slice | None:
    """The rows whose logits are wanted: every row, or each item's last where last_only says so."""
    if not last_only:
        return None
    flags = last_only if isinstance(last_only, list) else [True] * len(entries)
    return pack.put(
        r for e, last in zip(entries, flags) for r in ((e.r0 + e.n - 1,) if last else range(e.r0, e.r0 + e.n))
    )
