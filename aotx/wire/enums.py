"""The protocol's constants, its enums and flag bits, :class:`Reason` and :class:`WireError`."""

from __future__ import annotations

import enum

MAGIC = 0x58544F41  # b"AOTX" read little endian
VERSION = 1
MAX_PACKET = 65536
HEADER_SIZE = 128
MAX_PAYLOAD = MAX_PACKET - HEADER_SIZE
DIGEST_SIZE = 32
IDENTITY_SIZE = 16
ZERO_IDENTITY = bytes(IDENTITY_SIZE)


class Op(enum.IntEnum):
    """Operation codes (header offset 6)."""

    INFO = 1  #: Read the information payload (models and limits).
    SUBMIT = 2  #: Admit a request (submission payload).
    READ = 3  #: Read one output window of a request at ``cursor``.
    CANCEL = 4  #: Request cancellation of a request by identity.
    GRANT_INSTALL = 5  #: Install grant rows (row count at offset 76).
    GRANT_READ = 6  #: Read installed grant rows.
    WAIT = 7  #: Wait until a request has bytes past ``cursor`` or changes state.
    MEDIA_PUT = 8  #: Media source upload chunk.
    MEDIA_LIST = 9  #: Media list page (80-byte rows).
    SHARED_SAVE = 10  #: Shared conversation operations (reserved by the seed, not provided).
    SHARED_LOAD = 11
    POLICY = 12  #: Resident policy read/control.
    TELEMETRY = 13  #: Telemetry sample.
    MEDIA_READ = 14  #: Media source read (metadata) and removal.
    MEDIA_DELETE = 15
    METRICS = 16  #: Device counters for /metrics (payload: UTF-8 JSON; not a hot path).
    BROKER_STATS = 17  #: Broker counters, answered by the broker itself (payload: UTF-8 JSON).
    MEMORY = 18  #: The caller's automatic memory (sub-operation at offset 72, payload UTF-8 JSON).
    UNPARK = 19  #: Answer the caller's WAITs on a request, or its EMBED (withdrawn), now: the caller left.
    EMBED = 20  #: Embed inputs (payload: encode_embed) with a model (role): unit float32 vectors.
    WAITS = 21  #: Several WAITs in one packet, answered together (encode_waits; protocol.md 10.1).
    MODELS = 22  #: The models' residency (payload: UTF-8 JSON); with a payload, an admin's load or unload.


class MemoryOp(enum.IntEnum):
    """Sub-operations of Op.MEMORY (``memory_op``; approve and reject name ``pending_id``)."""

    READ = 1
    ERASE = 2
    PENDING = 3
    APPROVE = 4
    REJECT = 5


class Phase(enum.IntEnum):
    """Request phases, in the seed's order.  Anything >= COMPLETED is terminal."""

    FREE = 0
    QUEUED = 1
    PREPARING = 2
    RUNNING = 3
    COMPLETED = 4
    FAILED = 5
    CANCELLED = 6

    @property
    def terminal(self) -> bool:
        return self >= Phase.COMPLETED


class Finish(enum.IntEnum):
    NONE = 0
    STOP = 1
    LENGTH = 2


class Role(enum.IntEnum):
    """Message roles in submission payloads."""

    SYSTEM = 0
    USER = 1
    ASSISTANT = 2
    TOOL = 3  # ours: a tool's result, with a FIELDS part naming its tool_call_id


class ToolFormat(enum.IntEnum):
    """How a model's chat template writes tool calls (its information row; a SUBMIT's
    flags bits 4-5 name the one the request's output follows)."""

    FALLBACK = 0  #: the template knows no tools: the gateway writes them as text (Hermes)
    HERMES = 1  #: the template renders tools; a call is ``<tool_call>`` JSON ``</tool_call>``
    LLAMA3 = 2  #: the template renders tools; a call is one JSON ``{"name", "parameters"}``
    #: gpt-oss's harmony: a call is the commentary channel after the analysis one,
    #: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`` its arguments
    HARMONY = 3


class PartKind(enum.IntEnum):
    TEXT = 0
    IMAGE_DIGEST = 1
    AUDIO_DIGEST = 2
    TOKENS = 3  # ours: u32 token ids, only in a raw prompt (SUBMIT_FLAG_RAW)
    FIELDS = 4  # ours: a JSON object of template fields (tool_calls, tool_call_id), one a message


class Action(enum.IntFlag):
    """Grant action bits.  POLICY_READ (8) and POLICY_CONTROL (128) are the seed's."""

    SUBMIT = 1
    READ = 2
    CANCEL = 4
    POLICY_READ = 8
    TELEMETRY = 16
    MEDIA = 32
    ADMIN = 64
    POLICY_CONTROL = 128

    @classmethod
    def all(cls) -> Action:
        return cls(255)


#: Header flags for MEDIA_PUT (offset 116).
MEDIA_FLAG_FINAL = 1  # the last chunk: assemble, hash and check the source
MEDIA_FLAG_ABORT = 2  # drop the upload in progress
MEDIA_FLAG_EPHEMERAL = 4  # a request's inline media: removed when its last lease ends
MEDIA_LIST_MAX_ROWS = MAX_PACKET // 80 - 2  # 817 rows fit one reply


#: Header flags for SUBMIT (offset 116).
SUBMIT_FLAG_SEED = 1  # the seed field at 120 is meaningful
SUBMIT_FLAG_MEMORY_OFF = 2  # the request opts out of automatic memory
SUBMIT_FLAG_RAW = 4  # one message of one part, the prompt itself: no chat template
SUBMIT_FLAG_TOOLS = 8  # the output is tool calls' format: kept, and in every state reply
SUBMIT_TOOL_FORMAT_SHIFT = 4  # bits 4-5: the ToolFormat of the calls (kept with the flag above)
SUBMIT_TOOL_FORMAT = 3 << SUBMIT_TOOL_FORMAT_SHIFT
SUBMIT_FLAG_KEEP_ALIVE = 64  # keep_alive_ms at 64 is meaningful (a model loaded on first use)
KEEP_ALIVE_FOREVER = (1 << 64) - 1  # keep_alive_ms: the model stays loaded for ever
SUBMIT_FLAG_DRY = 128  # a dry run: checked, rendered and tokenized, answered 200, not admitted
SUBMIT_DRY_TOKENS = 256  # a dry run's reply lists the prompt's token ids (i32 each)
SUBMIT_DRY_PIECES = 512  # ... the token ids with their bytes (encode_pieces)
SUBMIT_DRY_TEXT = 1024  # ... the chat template's rendering, UTF-8
SUBMIT_DRY_BARE = 2048  # a dry raw text: no BOS/EOS added (llama-server's add_special false)
SUBMIT_DRY_SPECIAL = 4096  # a dry raw text: its special-token texts are those tokens
#: The bits that only a dry run (SUBMIT_FLAG_DRY) may set.
SUBMIT_DRY_ONLY = (SUBMIT_DRY_TOKENS | SUBMIT_DRY_PIECES | SUBMIT_DRY_TEXT | SUBMIT_DRY_BARE
                   | SUBMIT_DRY_SPECIAL)
CANCEL_FLAG_ADMIN = 1  # cancel any principal's request (needs Action.ADMIN)
READ_FLAG_ANNOTATIONS = 1  # READ/WAIT: the request's annotation stream, not its output
#: A request's state reply (``flags``), set by the device beside the SUBMIT flags it keeps:
STATE_FLAG_THINKS = 1 << 16  # the model's template thinks: the output may open with <think>
STATE_FLAG_THINK_OPEN = 1 << 17  # the prompt opened the think block: the output starts in it
STATE_FLAG_CHANNELS = 1 << 18  # with THINKS: the thinking is gpt-oss's analysis channel
#: What opens and closes a think block in the output's text: the <think> family's tags,
#: or gpt-oss's channels (llama.cpp renders <|channel|>, <|message|> and <|start|> as
#: text; the <|end|> between the two channels is a control token, rendered as nothing).
THINK_TAGS = ("<think>", "</think>")
CHANNEL_TAGS = ("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>")
#: What opens gpt-oss's next channel after the analysis one: ``final``, or a tool call's
#: ``commentary`` (CHANNEL_CALL; such an answer is the call from its ``<|channel|>``).
CHANNEL_START = "<|start|>assistant"
CHANNEL_NEXT = CHANNEL_START + "<|channel|>"
CHANNEL_CALL = CHANNEL_NEXT + "commentary"


def think_tags(flags: int) -> tuple[str, str]:
    """The think block's opening and closing text for a request of these state flags."""
    return CHANNEL_TAGS if flags & STATE_FLAG_CHANNELS else THINK_TAGS


class Reason(enum.IntEnum):
    """Why a reply refuses, a request failed (codes from 60) or a source was refused: offset
    28 of a reply.  No text crosses the wire: the gateway words the code (gateway/errors.py)
    with the number at offset 120 (``detail``) that a member names."""

    NONE = 0
    MALFORMED = 1  #: the codec refused a header or payload (a peer's bug; the receiver logs which)
    VERSION = 2  #: the header's version is not ``VERSION`` (505)
    TOO_LARGE = 3  #: the packet or a payload does not fit ``MAX_PACKET`` (413)
    NONZERO_FIELD = 4  #: a field this operation does not use is not zero; detail: its header offset
    NOT_SUPPORTED = 5  #: the operation is not provided here (501), as ops 10 and 11
    NO_MAILBOX = 6  #: the broker has no free mailbox (503)
    INTERNAL = 7  #: the device failed (500); its log says why
    NO_GRANT = 10  #: no grant row is installed for the principal
    ACTION = 11  #: the grant lacks an action; detail: the action bit(s) needed
    NO_MODEL = 12  #: no such model role, or not in the grant's model mask
    NO_REQUEST = 13  #: unknown, foreign, reclaimed or revoked-revision request
    EPOCH_ENDED = 14  #: the handle's runtime epoch has ended (410)
    EPOCH_MISMATCH = 15  #: a mutation's frame epoch is not the device's
    CURSOR = 16  #: the cursor (offset 64) is past the bytes produced (offset 76)
    INPUT_BYTES = 20  #: the submission is larger than the grant allows; detail: the grant's bytes
    PROMPT_LENGTH = 21  #: the prompt (offset 80 tokens) leaves no room; detail: the most the model takes
    OUTPUT_TOKENS = 22  #: max_tokens is over the limit; detail: the limit
    DEVICE_BUSY = 23  #: the device holds its maximum of active requests (429)
    ACTIVE_LIMIT = 24  #: the principal holds the grant's active requests; detail: that limit (429)
    RATE_LIMIT = 25  #: the principal used its admissions a minute; detail: that rate (429)
    TEMPLATE = 26  #: the model's chat template refused the messages (raise_exception)
    TEMPLATE_FAILED = 27  #: the chat template failed, or ran past its time or output bounds
    MODALITY = 28  #: the model takes no such input; detail: the PartKind
    NO_SOURCE = 29  #: a digest names no ready source of the principal; detail: the media part's index
    NO_PROJECTOR = 30  #: the model has no projector for media input
    IMAGE_UNREADABLE = 31  #: media part (detail) is an image the decoder cannot read
    IMAGE_PIXELS = 32  #: media part (detail) is an image of more than ``config.MAX_IMAGE_PIXELS``
    AUDIO_UNREADABLE = 33  #: media part (detail) is audio the decoder cannot read
    AUDIO_RATE = 34  #: media part (detail) has a sample rate outside ``config.AUDIO_RATES``
    AUDIO_LENGTH = 35  #: media part (detail) lasts longer than ``config.MAX_AUDIO_SECONDS``, or does not say
    MEDIA_LAST = 36  #: the prompt must end with text after its last media part
    MEDIA_PREPARE = 37  #: the projector could not preprocess the media
    SPECIAL_TEXT = 38  #: a message's text holds special-token text the chat template changes; detail: the message
    LOGIT_BIAS = 39  #: a logit-bias token id is not in the model's vocabulary; detail: that id
    NO_SOURCE_ID = 40  #: no such source of the principal
    UPLOAD_OFFSET = 41  #: no upload in progress at that offset, or the chunk does not follow the last
    CONTENT_TYPE = 42  #: unknown content type code (415)
    SOURCE_COUNT = 43  #: the grant's media sources are all used; detail: that count
    SOURCE_BYTES = 44  #: the source exceeds the bytes allowed; detail: those bytes
    LEASED = 45  #: the source is leased by requests; detail: how many
    EMPTY = 46  #: a refused source: it is empty
    MAGIC = 47  #: a refused source: its bytes are not its declared content type
    MEDIA_SHARE = 48  #: the principal's sources would pass its share of media bytes; detail: it
    MEDIA_POOL = 49  #: the device's media pool (all principals' sources) is full (507)
    POLICY_OFF = 50  #: the resident policy is off (no qualified model)
    STALE_REVISION = 51  #: the control revision is stale; the 160-byte status says the current one
    NO_DECISION = 52  #: no such pending memory decision
    MEMORY_OP = 53  #: unknown memory sub-operation
    GRAMMAR = 54  #: the constraint cannot be compiled or enforced; payload: UTF-8 JSON, why
    PROMPT_TOKEN = 55  #: a raw prompt's token id is not in the model's vocabulary; detail: it
    TOOL_FORMAT = 56  #: the tools' fields or format are not the model's template's; detail: its ToolFormat
    TOOL_TEXT = 57  #: a tool, call or call id holds special-token text; detail: the message (count: the tools)
    ENGINE_FEATURE = 58  #: the model's engine does not provide it (501); detail: an EngineFeature
    TEMPLATE_ARGS = 59  #: a template argument is the template's own variable, or holds special-token text
    KV_FULL = 60  #: the engine ran out of KV cache (503)
    DECODE = 61  #: llama_decode failed (500)
    MEDIA_ENCODE = 62  #: encoding a media part failed (500)
    GRAMMAR_FAILED = 63  #: the constraint's matcher failed while generating (500)
    WITHDRAWN = 64  #: an EMBED call was withdrawn: its ``wait_ms`` ran out, or its caller sent UNPARK (503)
    MODEL_LOAD = 65  #: the model, loaded on demand, could not be loaded (503; the device's log says why)
    MODEL_UNLOADED = 66  #: the model is loaded on demand and not loaded now: an EMBED asks its load; send it again (503)
    MODEL_ROOM = 67  #: the model did not fit the memory budget within the load wait: the others are in use (503)
    MODEL_FIXED = 68  #: the model is loaded at start, not on demand: it is not loaded or unloaded (409)
    TOKEN_ID = 70  #: an EMBED input (its index at offset 64) holds a token id outside the vocabulary; detail: the id


class WireError(Exception):
    """A packet or payload that cannot be accepted: the peer gets ``status`` and ``reason``
    (and ``detail``); ``message`` stays in this process's log."""

    def __init__(self, message: str, status: int = 400, reason: Reason = Reason.MALFORMED,
                 detail: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason
        self.detail = detail


def _check_enum(enum_type: type[enum.IntEnum], value: int, what: str) -> None:
    # A dict lookup, not enum_type(value): an enum costs microseconds, on every packet.
    if value not in enum_type._value2member_map_:
        raise WireError(f"unknown {what} {value}")
