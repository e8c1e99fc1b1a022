"""Structured output in the loop: forced tokens join the draft for free.

The services mask the laws (the verifier p, the drafter q: specd_core/runtime/grammar.py);
the orchestrator keeps its own matcher at the committed tokens, for two things:

* an n-gram draft is cut at its first token the constraint forbids (the
  verifier would reject it anyway, and everything after it);
* where the constraint allows only one way on - `{"name": ` after an object
  opens, a closing bracket, the tail of an enum value - those tokens (llguidance's
  fast-forward tokens) are appended to a chain's end as drafted tokens with
  q = 1 at each, made by no drafter call. A token drawn from a one-point q is
  a valid proposal like any other, so the acceptance rule keeps the output
  exact; where the constraint's mask holds that token alone the masked p is 1
  there too and the verifier always keeps it.

Trees get no forced tail (a tail per leaf would multiply the rows); they are
still masked everywhere.
"""

from __future__ import annotations

from orchestrator.cycle.records import Draft
from specd_core.runtime.grammar import Constraint


def is_chain(draft: Draft) -> bool:
    return draft.parents == list(range(-1, len(draft.tokens) - 1))


def cut_forbidden(draft: Draft, constraint: Constraint) -> None:
    """Cut a chain at its first token the constraint forbids (n-gram drafts:
    a drafter's own are masked already)."""
    ok = constraint.valid_prefix(draft.tokens)
    if ok < len(draft.tokens):
        del draft.tokens[ok:], draft.parents[ok:]
        del draft.confidences[ok:]
        if draft.row_dists:
            del draft.row_dists[ok + 1 :]
            draft.row_dists[ok] = ([], [])


def add_forced(draft: Draft, constraint: Constraint, room: int) -> int:
    """Append the tokens the constraint forces after a chain (at most `room`);
    how many (draft.tail: no drafter forwarded them)."""
    if room <= 0 or not is_chain(draft):
        return 0
    forced = constraint.forced(draft.tokens)[:room]
    if not forced:
        return 0
    n = len(draft.tokens)
    if draft.row_dists:
        # Sampled children carry their q per row: each forced token was drawn
        # from the one-point law at its parent's row (the chain's leaf row
        # had none), and the new leaf's row is empty.
        draft.row_dists[n] = ([forced[0]], [1.0])
        draft.row_dists += [([t], [1.0]) for t in forced[1:]] + [([], [])]
    if draft.confidences:  # n-gram drafts carry none
        draft.confidences += [1.0] * len(forced)
    draft.tokens += forced
    draft.parents += list(range(n - 1, n - 1 + len(forced)))
    draft.forced_nodes += range(n, n + len(forced))
    draft.tail += len(forced)
    return len(forced)


def shape_draft(draft: Draft, constraint: Constraint, room: int, cut: bool) -> Draft:
    """The draft the verifier gets: cut at a forbidden token (cut: the draft
    was not masked where it was made), then the forced tail within `room`
    tokens of draft depth in all."""
    if cut and draft.tokens and is_chain(draft):
        cut_forbidden(draft, constraint)
    add_forced(draft, constraint, room - len(draft.tokens))
    return draft
