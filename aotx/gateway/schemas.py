"""Response documents of the HTTP API, as pydantic models.

The routes build their JSON by hand (orjson, no validation on the hot path);
these models exist so that the OpenAPI document describes every response body
exactly, and schemathesis checks each live response against it
(``tests/e2e/test_schemathesis.py``).  A field added to a route and not here makes
that test fail.

64-bit counters and cursors are decimal strings (JSON numbers lose precision
past 2^53); token counts are plain integers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Statuses any authenticated route can answer (see docs/api.md for which and why).
COMMON_ERRORS = (400, 401, 403, 404, 405, 408, 409, 410, 413, 415, 421, 422, 429, 431, 503)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


Decimal = str  # a non-negative integer written in decimal (fits in 64 bits)
_DEC = Field(pattern=r"^[0-9]+$")


class ErrorObject(_Doc):
    message: str
    type: str
    code: str | None
    param: str | None


class ErrorResponse(_Doc):
    """The standard error object every route answers with on failure."""

    error: ErrorObject


class AnthropicErrorObject(_Doc):
    type: str
    message: str


class AnthropicErrorResponse(_Doc):
    """Anthropic's error envelope: every error of the Messages routes."""

    type: Literal["error"]
    error: AnthropicErrorObject


class Health(_Doc):
    status: str


class Ready(_Doc):
    status: Literal["ready", "not ready"]
    runtime_epoch: Decimal = _DEC


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class MediaHandle(_Doc):
    """A media source a request leased: the handle to remove it by, and its digest."""

    id: Annotated[str, Field(pattern=r"^src-[0-9a-f]{32}$")]
    digest: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]


class Admission(_Doc):
    """``aotx.admission.v1``: the answer to a native submission."""

    schema_: Literal["aotx.admission.v1"] = Field(alias="schema")
    id: str
    runtime_epoch: Decimal = _DEC
    state: Literal["accepted"]
    persistence: Literal["ephemeral"]
    media: list[MediaHandle] = Field(
        description="the media sources this request leased, in prompt order: the seed's "
                    "media handles (remove a source by its id once its leases end)")


_STATES = Literal["free", "queued", "preparing", "running", "completed", "failed", "cancelled"]
_FINISH = Literal["stop", "length"] | None


class RequestState(_Doc):
    """``aotx.request.v1`` without a window (the answer to a cancel)."""

    schema_: Literal["aotx.request.v1"] = Field(alias="schema")
    id: str
    runtime_epoch: Decimal = _DEC
    model: str | None
    model_role: int
    state: _STATES
    cancel_requested: bool
    finish_reason: _FINISH
    failure: ErrorObject | None
    usage: Usage
    tools: bool = Field(description="tools were offered: the output is in the tool-call "
                                    "format, parsed at .../tool_calls")


class OutputWindow(_Doc):
    encoding: Literal["base64"]
    bytes: str
    cursor: Decimal = _DEC
    next_cursor: Decimal = _DEC
    total_bytes: Decimal = _DEC


class RequestWindow(RequestState):
    """``aotx.request.v1``: state plus the output bytes from ``cursor`` on."""

    output: OutputWindow


class MediaSource(_Doc):
    """``aotx.media.v1``."""

    schema_: Literal["aotx.media.v1"] = Field(alias="schema")
    id: str = Field(pattern=r"^src-[0-9a-f]{32}$")
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    kind: Literal["image", "audio"]
    content_type: str
    bytes: Decimal = _DEC
    state: Literal["receiving", "ready", "refused"]
    reason: str | None
    leases: int
    created: str


class MediaList(_Doc):
    schema_: Literal["aotx.media_list.v1"] = Field(alias="schema")
    data: list[MediaSource]
    next_cursor: Decimal | None


class Policy(_Doc):
    """``aotx.policy.v1``: the resident policy's status record."""

    schema_: Literal["aotx.policy.v1"] = Field(alias="schema")
    runtime_epoch: Decimal = _DEC
    mode: str
    abi: int
    state: Literal["off", "quiet", "active", "paused", "stopped", "error", "recording"]
    review_enabled: bool
    pending: int
    active_rows: int
    result_status: int
    control_revision: Decimal = _DEC
    source_frontier: Decimal = _DEC
    completed: Decimal = _DEC
    interrupted: Decimal = _DEC
    refused: Decimal = _DEC
    decision: Decimal = _DEC
    saved_generation: Decimal = _DEC
    max_ns: Decimal = _DEC
    last_ns: Decimal = _DEC
    written_bytes: Decimal = _DEC
    result_bytes: Decimal = _DEC
    reason: Literal["quiet", "foreground", "paused", "capacity", "active", "disabled"]


class Memory(_Doc):
    schema_: Literal["aotx.memory.v1"] = Field(alias="schema")
    generation: Decimal = _DEC
    facts: list[str]


class PendingFact(_Doc):
    id: Decimal = _DEC
    fact: str


class MemoryPending(_Doc):
    schema_: Literal["aotx.memory_pending.v1"] = Field(alias="schema")
    data: list[PendingFact]


class PendingDecision(_Doc):
    id: Decimal = _DEC
    decision: Literal["approve", "reject"]


class Limits(_Doc):
    max_packet_bytes: Decimal = _DEC
    max_payload_bytes: Decimal = _DEC
    window_bytes: Decimal = _DEC
    context_tokens: Decimal = _DEC
    output_tokens: Decimal = _DEC
    active_requests: Decimal = _DEC
    slots: Decimal = _DEC
    kv_cells: Decimal = Field(pattern=r"^[0-9]+$", description="KV cells of all models' "
                              "pools (tokens of context the sequences share)")
    media_bytes: Decimal = _DEC
    body_bytes: Decimal = _DEC
    retention_seconds: Decimal = _DEC
    retention_requests: Decimal = _DEC
    constraint_bytes: Decimal = _DEC
    constraint_depth: Decimal = _DEC
    choices: Decimal = _DEC
    embedding_inputs: Decimal = _DEC


class EmbeddingsCapability(_Doc):
    """What a model's ``/v1/embeddings`` gives: vectors of ``dimensions`` float32 values
    (unit length), from inputs of at most ``max_input_tokens`` tokens."""

    dimensions: int
    max_input_tokens: int


class ModelStatus(_Doc):
    value: Literal["unloaded", "loading", "loaded", "unloading", "failed"] = Field(
        description="loaded at start, or loaded on first use and unloaded when idle")
    reason: str | None = Field(description="failed: why its load failed")
    on_demand: bool = Field(description="loaded on first use (false: loaded at start, pinned)")
    file_bytes: int
    memory_bytes: int = Field(description="its memory when loaded, estimated: weights, KV, "
                                          "compute buffers")
    vram_bytes: int = Field(description="the part of memory_bytes on the GPU (gpu_layers)")
    sha256: str | None = Field(description="its file's, once hashed (null: not yet)")
    keep_alive: float = Field(description="seconds it stays loaded idle; -1: pinned")
    expires_in: float | None = Field(description="seconds until it unloads, idle; null: "
                                                  "not idle, not loaded or pinned")


class ModelEntry(_Doc):
    alias: str
    role: int
    model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    input_modalities: list[Literal["text", "image", "audio"]]
    published_at: str
    context_tokens: Decimal = _DEC
    automatic_memory: bool
    chat: bool = Field(description="false: an embedding model or a reranker (no chat "
                                   "requests)")
    tool_format: Literal["fallback", "hermes", "llama3", "harmony"] = Field(
        description="how the model's chat template writes tools (fallback: aotx writes "
                    "them as text)")
    embeddings: EmbeddingsCapability | None
    rerank: bool = Field(description="a reranker: it answers /v1/rerank alone")
    status: ModelStatus | None


class Features(_Doc):
    requests: bool
    windows: bool
    events: bool
    cancel: bool
    media: bool
    telemetry: bool
    metrics: bool
    policy: bool
    automatic_memory: bool
    shared_operations: bool
    response_format: list[Literal["text", "json_object", "json_schema"]]
    tool_choice: list[Literal["none", "auto", "required", "function"]] = Field(
        description="the tool_choice values taken (function: a named function)")
    top_logprobs: int = Field(description="the most alternatives logprobs list per token")
    embeddings: bool
    rerank: bool


class Lineage(_Doc):
    kind: Literal["automatic_memory"]
    path: str


class Capabilities(_Doc):
    schema_: Literal["aotx.capabilities.v1"] = Field(alias="schema")
    runtime_epoch: Decimal = _DEC
    device_id: Decimal = _DEC
    limits: Limits
    models: list[ModelEntry]
    features: Features
    lineage: Lineage | None


class TelemetrySample(_Doc):
    service_allocation_bytes: Decimal = _DEC
    device_tick: Decimal = _DEC
    device_clock_ns: Decimal = _DEC


class Telemetry(_Doc):
    schema_: Literal["aotx.telemetry.v1"] = Field(alias="schema")
    runtime_epoch: Decimal = _DEC
    sample: TelemetrySample
    affect: None
    expression: None


class OpenAIModel(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    automatic_memory: bool
    chat: bool = Field(description="false: an embedding model or a reranker (no chat "
                                   "requests)")
    tool_format: Literal["fallback", "hermes", "llama3", "harmony"] = Field(
        description="how the model's chat template writes tools (fallback: aotx writes "
                    "them as text)")
    embeddings: EmbeddingsCapability | None
    rerank: bool = Field(description="a reranker: it answers /v1/rerank alone")
    status: ModelStatus | None


class ResidencyEntry(_Doc):
    alias: str
    role: int
    status: ModelStatus
    loads: int
    evictions: int = Field(description="unloads to make room for another model")
    unload_asked: bool = Field(description="an admin asked for its unload: once its requests end")


class Unassigned(_Doc):
    alias: str
    path: str
    file_bytes: int
    state: Literal["no_role"]
    reason: str


class Models(_Doc):
    schema_: Literal["aotx.models.v1"] = Field(alias="schema")
    budget_bytes: int = Field(description="what the models' estimated memory may take together")
    used_bytes: int = Field(description="the estimated memory of the models loaded or "
                                        "loading (another caller's: of its models only)")
    models: list[ResidencyEntry]
    unassigned: list[Unassigned] | None = Field(
        description="the models folder's files beyond the 31 roles (shown to an admin)")


class Embedding(_Doc):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(
        description="the unit vector: numbers, or with encoding_format \"base64\" its "
                    "little-endian float32 bytes in base64")


class EmbeddingUsage(_Doc):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Doc):
    """The answer of ``POST /v1/embeddings``: one vector per input, in order."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankDocument(_Doc):
    text: str


class RerankResult(_Doc):
    index: int = Field(description="the document's place in the body's documents")
    relevance_score: float = Field(description="the reranker's score (its classifier head's "
                                               "output): higher is more relevant")
    document: RerankDocument | None = Field(default=None,
                                            description="with return_documents: true")


class RerankList(_Doc):
    """The answer of ``POST /v1/rerank``: the documents' scores, highest first."""

    id: str
    object: Literal["list"]
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class OpenAIModelList(_Doc):
    object: Literal["list"]
    data: list[OpenAIModel]


class FunctionCallOut(_Doc):
    name: str
    arguments: str  #: a JSON object, as a string


class ToolCallOut(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Doc):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = Field(default=None, description="a thinking model's "
                                                                    "thinking (no tags)")


class TopLogprob(_Doc):
    token: str = Field(description="the token's bytes as UTF-8 (U+FFFD for a partial "
                                   "character; a special token adds no bytes: \"\")")
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(
        description="the top_logprobs likeliest tokens, likeliest first (tokens a grammar "
                    "forbids are left out)")


class ChoiceLogprobs(_Doc):
    content: list[TokenLogprob]
    refusal: None


class ChatChoice(_Doc):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Doc):
    """A non-streaming ``chat.completion``; with ``stream: true`` the route answers
    ``text/event-stream`` of ``chat.completion.chunk`` objects instead."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class NativeTopLogprob(TopLogprob):
    token_id: int


class NativeTokenLogprob(NativeTopLogprob):
    offset: int = Field(description="where the token's bytes start in the output")
    top_logprobs: list[NativeTopLogprob]


class LogprobsWindow(_Doc):
    cursor: Decimal = _DEC
    next_cursor: Decimal = _DEC
    total_bytes: Decimal = Field(pattern=r"^[0-9]+$",
                                 description="the bytes of the request's logprobs stream so "
                                             "far (cursors are positions in it)")
    content: list[NativeTokenLogprob]


class RequestLogprobs(RequestState):
    """``aotx.logprobs.v1``: state plus the tokens' logprobs from ``cursor`` on."""

    schema_: Literal["aotx.logprobs.v1"] = Field(alias="schema")  # type: ignore[assignment]
    logprobs: LogprobsWindow


class RequestToolCalls(RequestState):
    """``aotx.tool_calls.v1``: state plus the output parsed as the standard route parses
    it: the text before the first call and every complete call."""

    schema_: Literal["aotx.tool_calls.v1"] = Field(alias="schema")  # type: ignore[assignment]
    message: ChatMessageOut


class RequestMessage(RequestState):
    """``aotx.message.v1``: state plus the output parsed as chat parses it: the thinking
    (``reasoning_content``, a thinking model's), the calls (tools offered) and the text."""

    schema_: Literal["aotx.message.v1"] = Field(alias="schema")  # type: ignore[assignment]
    message: ChatMessageOut


class CompletionLogprobs(_Doc):
    """OpenAI's legacy logprobs: four arrays, one entry per output token."""

    tokens: list[str] = Field(description="each token's text: the characters whose last "
                                          "byte it holds (joined: the choice's text)")
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] = Field(
        description="the logprobs likeliest tokens and the sampled one, by their text")
    text_offset: list[int] = Field(description="where each token's text starts in the "
                                               "choice's text, in characters")


class CompletionChoice(_Doc):
    index: int = Field(description="prompt index x n + choice")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(_Doc):
    """A non-streaming ``text_completion``; with ``stream: true`` the route answers
    ``text/event-stream`` of ``text_completion`` chunks instead."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class ResponseUsage(_Doc):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseError(_Doc):
    code: str
    message: str


class IncompleteDetails(_Doc):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Doc):
    """OpenAI's response object (``/v1/responses``): a device request's state and output;
    the request's fields as it was created when it was stored, else their defaults."""

    id: Annotated[str, Field(pattern=r"^resp_[0-9a-f]{48}$")]
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    model: str
    instructions: str | None
    metadata: dict[str, str]
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: str | None
    background: bool
    store: bool
    truncation: Literal["disabled"]
    output: list[dict[str, Any]] = Field(
        description="a message item (type message, output_text content) and, with tools, "
                    "function_call items")
    usage: ResponseUsage | None


class ResponseDeleted(_Doc):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(_Doc):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
