from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "structured_output", "cache_salt")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    structured_output: StructuredOutput
    cache_salt: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "regex", "ebnf", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    ebnf: str
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DraftShape(_message.Message):
    __slots__ = ("branching", "node_budget", "max_depth", "top_k", "paths", "min_confidence")
    BRANCHING_FIELD_NUMBER: _ClassVar[int]
    NODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    branching: _containers.RepeatedScalarFieldContainer[int]
    node_budget: int
    max_depth: int
    top_k: int
    paths: _containers.RepeatedCompositeFieldContainer[TreePath]
    min_confidence: float
    def __init__(self, branching: _Optional[_Iterable[int]] = ..., node_budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., top_k: _Optional[int] = ..., paths: _Optional[_Iterable[_Union[TreePath, _Mapping]]] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class TreePath(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("data", "rows", "hidden_size", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    rows: int
    hidden_size: int
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., rows: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class OpenDraftSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "target_vocab_size", "generated_from", "owner")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FROM_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    target_vocab_size: int
    generated_from: int
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., target_vocab_size: _Optional[int] = ..., generated_from: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class OpenDraftSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "accepted_path", "committed_token_ids", "num_draft_tokens", "shape", "request_id", "traceparent", "ahead", "rewind", "hidden_states", "ahead_alternatives", "ahead_branch", "forced_room")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_BRANCH_FIELD_NUMBER: _ClassVar[int]
    FORCED_ROOM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    shape: DraftShape
    request_id: int
    traceparent: str
    ahead: bool
    rewind: bool
    hidden_states: HiddenStates
    ahead_alternatives: int
    ahead_branch: int
    forced_room: int
    def __init__(self, session_id: _Optional[str] = ..., accepted_path: _Optional[_Iterable[int]] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., shape: _Optional[_Union[DraftShape, _Mapping]] = ..., request_id: _Optional[int] = ..., traceparent: _Optional[str] = ..., ahead: _Optional[bool] = ..., rewind: _Optional[bool] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ..., ahead_alternatives: _Optional[int] = ..., ahead_branch: _Optional[int] = ..., forced_room: _Optional[int] = ...) -> None: ...

class AheadBranch(_message.Message):
    __slots__ = ("kept", "token_id", "draft_token_ids", "draft_distributions", "draft_confidences", "confidence_pruned")
    KEPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_PRUNED_FIELD_NUMBER: _ClassVar[int]
    kept: int
    token_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    draft_confidences: _containers.RepeatedScalarFieldContainer[float]
    confidence_pruned: int
    def __init__(self, kept: _Optional[int] = ..., token_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., draft_confidences: _Optional[_Iterable[float]] = ..., confidence_pruned: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_token_ids", "draft_parents", "draft_distributions", "compute_ms", "request_id", "error", "batch_sessions", "batch_tokens", "guessed_token_id", "branches", "draft_confidences", "confidence_pruned", "forced_nodes")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUESSED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_PRUNED_FIELD_NUMBER: _ClassVar[int]
    FORCED_NODES_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    compute_ms: float
    request_id: int
    error: CallError
    batch_sessions: int
    batch_tokens: int
    guessed_token_id: int
    branches: _containers.RepeatedCompositeFieldContainer[AheadBranch]
    draft_confidences: _containers.RepeatedScalarFieldContainer[float]
    confidence_pruned: int
    forced_nodes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., compute_ms: _Optional[float] = ..., request_id: _Optional[int] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., batch_sessions: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., guessed_token_id: _Optional[int] = ..., branches: _Optional[_Iterable[_Union[AheadBranch, _Mapping]]] = ..., draft_confidences: _Optional[_Iterable[float]] = ..., confidence_pruned: _Optional[int] = ..., forced_nodes: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeStep(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ...) -> None: ...

class ProposeStepResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ProposeResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ProposeResponse, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("engine", "architecture", "model_type", "dtype", "kv_dtype", "sessions", "kv_block_tokens", "kv_capacity_blocks", "kv_used_blocks", "kv_capacity_tokens", "kv_used_tokens", "kv_capacity_bytes", "kv_used_bytes", "model", "prefix_caching", "prefix_cached_blocks", "prefix_idle_blocks", "prefix_queried_tokens", "prefix_hit_tokens", "prefix_evicted_blocks", "drafting", "cuda_graphs")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IDLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    architecture: str
    model_type: str
    dtype: str
    kv_dtype: str
    sessions: int
    kv_block_tokens: int
    kv_capacity_blocks: int
    kv_used_blocks: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    kv_capacity_bytes: int
    kv_used_bytes: int
    model: str
    prefix_caching: bool
    prefix_cached_blocks: int
    prefix_idle_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_evicted_blocks: int
    drafting: str
    cuda_graphs: str
    def __init__(self, engine: _Optional[str] = ..., architecture: _Optional[str] = ..., model_type: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., sessions: _Optional[int] = ..., kv_block_tokens: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., model: _Optional[str] = ..., prefix_caching: _Optional[bool] = ..., prefix_cached_blocks: _Optional[int] = ..., prefix_idle_blocks: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_evicted_blocks: _Optional[int] = ..., drafting: _Optional[str] = ..., cuda_graphs: _Optional[str] = ...) -> None: ...

class OpenVerifySessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "resume", "return_hidden_states", "generated_from", "owner", "hidden_layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FROM_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    resume: bool
    return_hidden_states: bool
    generated_from: int
    owner: str
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., resume: _Optional[bool] = ..., return_hidden_states: _Optional[bool] = ..., generated_from: _Optional[int] = ..., owner: _Optional[str] = ..., hidden_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenVerifySessionResponse(_message.Message):
    __slots__ = ("first_token_id", "hidden_states", "cached_prompt_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    hidden_states: HiddenStates
    cached_prompt_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "draft_token_ids", "draft_parents", "draft_distributions", "request_id", "traceparent")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    request_id: int
    traceparent: str
    def __init__(self, session_id: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., request_id: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "token_ids", "accepted_path", "compute_ms", "request_id", "error", "batch_sessions", "batch_tokens", "hidden_states", "batch_id")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    compute_ms: float
    request_id: int
    error: CallError
    batch_sessions: int
    batch_tokens: int
    hidden_states: HiddenStates
    batch_id: int
    def __init__(self, num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., accepted_path: _Optional[_Iterable[int]] = ..., compute_ms: _Optional[float] = ..., request_id: _Optional[int] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., batch_sessions: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ..., batch_id: _Optional[int] = ...) -> None: ...

class VerifyStep(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyStepResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[VerifyResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[VerifyResponse, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_speculative_tokens", "tree", "speculative_method", "adaptive_speculation", "pipeline_drafting", "pipeline_alternatives", "confidence_threshold", "structured_output", "forced_drafting", "resume_token_ids", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DRAFTING_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FORCED_DRAFTING_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: PromptTokenIds
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_speculative_tokens: int
    tree: DraftShape
    speculative_method: str
    adaptive_speculation: bool
    pipeline_drafting: bool
    pipeline_alternatives: int
    confidence_threshold: float
    structured_output: StructuredOutput
    forced_drafting: bool
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[PromptTokenIds, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_speculative_tokens: _Optional[int] = ..., tree: _Optional[_Union[DraftShape, _Mapping]] = ..., speculative_method: _Optional[str] = ..., adaptive_speculation: _Optional[bool] = ..., pipeline_drafting: _Optional[bool] = ..., pipeline_alternatives: _Optional[int] = ..., confidence_threshold: _Optional[float] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., forced_drafting: _Optional[bool] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PromptTokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("cycles", "drafted_tokens", "accepted_tokens", "mean_accepted_length", "prompt_tokens", "completion_tokens", "num_speculative_tokens", "draft_compute_ms", "verify_compute_ms", "cycles_wall_ms", "cycle_overhead_ms", "method", "drafts", "accepted_per_position", "adaptive", "pipelined_drafts", "draft_wait_ms", "draft_call_ms", "feature_bytes", "pipelined_alternative_drafts", "confidence_stops", "forced_tokens", "forced_accepted", "resumed_tokens", "cached_prompt_tokens")
    CYCLES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    CYCLES_WALL_MS_FIELD_NUMBER: _ClassVar[int]
    CYCLE_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CALL_MS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_ALTERNATIVE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_STOPS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cycles: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted_length: float
    prompt_tokens: int
    completion_tokens: int
    num_speculative_tokens: int
    draft_compute_ms: float
    verify_compute_ms: float
    cycles_wall_ms: float
    cycle_overhead_ms: _containers.RepeatedScalarFieldContainer[float]
    method: str
    drafts: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    adaptive: bool
    pipelined_drafts: int
    draft_wait_ms: float
    draft_call_ms: float
    feature_bytes: int
    pipelined_alternative_drafts: int
    confidence_stops: int
    forced_tokens: int
    forced_accepted: int
    resumed_tokens: int
    cached_prompt_tokens: int
    def __init__(self, cycles: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., draft_compute_ms: _Optional[float] = ..., verify_compute_ms: _Optional[float] = ..., cycles_wall_ms: _Optional[float] = ..., cycle_overhead_ms: _Optional[_Iterable[float]] = ..., method: _Optional[str] = ..., drafts: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., adaptive: _Optional[bool] = ..., pipelined_drafts: _Optional[int] = ..., draft_wait_ms: _Optional[float] = ..., draft_call_ms: _Optional[float] = ..., feature_bytes: _Optional[int] = ..., pipelined_alternative_drafts: _Optional[int] = ..., confidence_stops: _Optional[int] = ..., forced_tokens: _Optional[int] = ..., forced_accepted: _Optional[int] = ..., resumed_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("drafters", "verifiers", "orchestrators")
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATORS_FIELD_NUMBER: _ClassVar[int]
    drafters: int
    verifiers: int
    orchestrators: int
    def __init__(self, drafters: _Optional[int] = ..., verifiers: _Optional[int] = ..., orchestrators: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("kind", "name", "address", "node", "sessions", "draining", "lost", "engine", "architecture", "dtype", "kv_capacity_tokens", "kv_used_tokens", "kv_capacity_bytes", "kv_used_bytes", "model_type", "metrics_address", "model", "prefix_queried_tokens", "prefix_hit_tokens", "drafting", "cuda_graphs")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    address: str
    node: str
    sessions: int
    draining: bool
    lost: bool
    engine: str
    architecture: str
    dtype: str
    kv_capacity_tokens: int
    kv_used_tokens: int
    kv_capacity_bytes: int
    kv_used_bytes: int
    model_type: str
    metrics_address: str
    model: str
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    drafting: str
    cuda_graphs: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., node: _Optional[str] = ..., sessions: _Optional[int] = ..., draining: _Optional[bool] = ..., lost: _Optional[bool] = ..., engine: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., model_type: _Optional[str] = ..., metrics_address: _Optional[str] = ..., model: _Optional[str] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., drafting: _Optional[str] = ..., cuda_graphs: _Optional[str] = ...) -> None: ...

class OrchestratorStatus(_message.Message):
    __slots__ = ("name", "address", "node", "pid", "active_requests", "max_active_requests", "draining", "metrics_address", "http_address", "owner")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    node: str
    pid: int
    active_requests: int
    max_active_requests: int
    draining: bool
    metrics_address: str
    http_address: str
    owner: bool
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., node: _Optional[str] = ..., pid: _Optional[int] = ..., active_requests: _Optional[int] = ..., max_active_requests: _Optional[int] = ..., draining: _Optional[bool] = ..., metrics_address: _Optional[str] = ..., http_address: _Optional[str] = ..., owner: _Optional[bool] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("replicas", "active_requests", "scalable", "autoscale", "metrics_address", "orchestrators", "max_active_requests", "answered_by")
    class AutoscaleEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCALABLE_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATORS_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    active_requests: int
    scalable: bool
    autoscale: _containers.ScalarMap[str, str]
    metrics_address: str
    orchestrators: _containers.RepeatedCompositeFieldContainer[OrchestratorStatus]
    max_active_requests: int
    answered_by: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., active_requests: _Optional[int] = ..., scalable: _Optional[bool] = ..., autoscale: _Optional[_Mapping[str, str]] = ..., metrics_address: _Optional[str] = ..., orchestrators: _Optional[_Iterable[_Union[OrchestratorStatus, _Mapping]]] = ..., max_active_requests: _Optional[int] = ..., answered_by: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    def __init__(self, owner: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("sessions", "owner_timeout_s")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OWNER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    owner_timeout_s: float
    def __init__(self, sessions: _Optional[int] = ..., owner_timeout_s: _Optional[float] = ...) -> None: ...
