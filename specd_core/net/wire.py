"""Proto <-> core dataclass conversions shared by the servicers and clients."""

from __future__ import annotations

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.errors import InvalidRequest
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.structured import OutputConstraint
from specd_core.runtime.propose_call import ProposeCall


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        structured_output=constraint_to_proto(p.constraint),
        cache_salt=p.cache_salt,
    )


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    # proto3 has no presence for plain floats: an unset top_p (0.0) means "off".
    return SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p or 1.0,
        top_k=sp.top_k,
        seed=sp.seed,
        constraint=constraint_from_proto(sp.structured_output, sp.HasField("structured_output")),
        cache_salt=sp.cache_salt,
    )


def dists_from_proto(dists) -> list[tuple[list[int], list[float]]]:
    return [(list(d.token_ids), list(d.probs)) for d in dists]


def dists_to_proto(dists) -> list[pb.SparseDistribution]:
    return [pb.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in dists]


def shape_to_proto(shape) -> pb.DraftShape:
    return pb.DraftShape(
        branching=list(shape.branching),
        node_budget=shape.node_budget,
        max_depth=shape.max_depth,
        top_k=shape.top_k,
        paths=[pb.TreePath(ranks=p) for p in shape.paths],
        min_confidence=shape.min_confidence,
    )


def shape_from_proto(msg: pb.DraftShape, default_top_k: int = 4):
    from specd_core.rules.draft_shape import DraftShape

    return DraftShape(
        branching=tuple(msg.branching),
        node_budget=msg.node_budget,
        max_depth=msg.max_depth,
        top_k=msg.top_k or default_top_k,
        paths=tuple(tuple(p.ranks) for p in msg.paths),
        min_confidence=msg.min_confidence,
    )


def hidden_to_proto(h) -> pb.HiddenStates | None:
    return None if h is None else pb.HiddenStates(data=h.data, rows=h.rows, hidden_size=h.hidden_size, dtype=h.dtype)


def hidden_from_proto(msg, present: bool):
    """present: the message's HasField("hidden_states")."""
    from specd_core.runtime.features import HiddenStates

    return HiddenStates(msg.data, msg.rows, msg.hidden_size, msg.dtype) if present else None


def propose_to_proto(call: ProposeCall) -> pb.ProposeRequest:
    return pb.ProposeRequest(
        session_id=call.session_id,
        accepted_path=call.accepted_path,
        committed_token_ids=call.committed,
        shape=shape_to_proto(call.shape),
        ahead=call.ahead,
        rewind=call.rewind,
        hidden_states=hidden_to_proto(call.hidden),
        ahead_alternatives=call.alternatives,
        ahead_branch=call.branch,
        forced_room=call.forced_room,
    )


def propose_from_proto(msg: pb.ProposeRequest, max_draft_tokens: int) -> ProposeCall:
    """max_draft_tokens: the drafter's limit, for a chain asked by
    num_draft_tokens alone (no `shape`)."""
    from specd_core.rules.draft_shape import DraftShape

    shape = (
        shape_from_proto(msg.shape)
        if msg.HasField("shape")
        else DraftShape.chain(msg.num_draft_tokens, max_draft_tokens)
    )
    return ProposeCall(
        session_id=msg.session_id,
        accepted_path=list(msg.accepted_path),
        committed=list(msg.committed_token_ids),
        shape=shape,
        ahead=msg.ahead,
        rewind=msg.rewind,
        hidden=hidden_from_proto(msg.hidden_states, msg.HasField("hidden_states")),
        alternatives=msg.ahead_alternatives,
        branch=msg.ahead_branch,
        forced_room=msg.forced_room,
    )


def constraint_to_proto(c: OutputConstraint | None) -> pb.StructuredOutput | None:
    if c is None:
        return None
    if c.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    msg = pb.StructuredOutput()
    setattr(msg, c.kind, c.text)
    return msg


def constraint_from_proto(msg: pb.StructuredOutput, present: bool) -> OutputConstraint | None:
    """None when the field is unset; a set message with no kind (or
    json_object false) is refused by OutputConstraint.validate."""
    if not present:
        return None
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        raise InvalidRequest(
            "structured_output is set but names no constraint: give json_schema, regex, ebnf or json_object: true"
        )
    return OutputConstraint(kind, "" if kind == "json_object" else getattr(msg, kind)).validate()
