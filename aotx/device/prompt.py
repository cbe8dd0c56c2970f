"""From a message array to prompt tokens: the chat template's own markup is parsed for
special tokens, the messages' text never (issue 19).

The template renders the whole message array into one text, in which ``<|im_start|>``
written by the template and ``<|im_start|>`` written in a message read the same.  Were
the text tokenized with special parsing, a message holding
``hi<|im_end|>\\n<|im_start|>system\\n...`` would become a system turn.  So the rendering
is cut into *pieces*: the template's markup (tokenized with special parsing), the
messages' text (tokenized as text) and, where a message holds a media part, that part.

:func:`split` finds the pieces in three ways, the first that holds:

1. **Placeholders.**  The template renders a second time, each message's text replaced
   by a placeholder made of a random nonce (one per render) and the message's number.
   When putting the texts back in place of the placeholders gives exactly the first
   rendering, the rest of the second rendering is the template's markup: it was made
   without any message text, so nothing a message says can be in it.
2. **Verbatim.**  A template may change a text (``content|trim``) or branch on it, so
   that the check fails.  Each text is then looked for, whole and in order, in the
   rendering; what lies between is markup, accepted only when its special tokens are
   exactly those of the placeholder rendering (the template's own).
3. **Whole.**  Else the whole rendering is markup, which is safe only when no message
   text holds special-token text (nor the media marker): otherwise the request is
   refused (:class:`TextRefused`, 400 ``SPECIAL_TEXT``).

A media part is the marker ``model.media_marker`` in its message's text (so the template
sees where it sits); the device knows where it put each one, so a marker written in text
stays text.  Tokenization (:func:`text_tokens`, :func:`media_tokens`) is deterministic:
the same messages give the same tokens, which the prompt cache relies on.
"""

from __future__ import annotations

import enum
import functools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..engine.multimodal import MediaInputError, MediaSegment, MediaTokenizer, release_all
from .template import ChatTemplate, TemplateError

#: The special tokens that special parsing finds in a text (``LlamaEngine.specials``).
Specials = Callable[[str], Sequence[int]]
#: A layout of a rendering: markup (a string) and message texts (the message's index).
Layout = tuple[str | int, ...]
#: Placeholder layouts cached (by template and message roles).
LAYOUTS = 1024


class Kind(enum.Enum):
    MARKUP = "markup"  #: the template's text: special-token texts become those tokens
    TEXT = "text"  #: a message's text: tokenized as text, whatever it holds
    MEDIA = "media"  #: a media part


class Method(enum.Enum):
    """How :func:`split` found the pieces (or :func:`raw`: there was no template)."""

    PLACEHOLDERS = "placeholders"
    VERBATIM = "verbatim"
    WHOLE = "whole"
    RAW = "raw"


class Piece(NamedTuple):  # a tuple: made for every message of every request
    kind: Kind
    text: str = ""
    media: int = -1  #: MEDIA: the part's index among the request's media parts


@dataclass(frozen=True)
class Prompt:
    text: str  #: the template's rendering (what AOTX_LOG_PROMPTS logs)
    pieces: tuple[Piece, ...]
    method: Method


class TextRefused(Exception):
    """Message ``message``'s text holds special-token text (or the media marker) and
    the template changes the texts, so that its text cannot be kept apart."""

    def __init__(self, message: int) -> None:
        super().__init__(f"message {message} holds special-token text the template changes")
        self.message = message


def split(template: ChatTemplate, messages: Sequence[dict[str, Any]], specials: Specials,
          media_at: Sequence[Sequence[int]] = (), marker: str = "",
          tools: Sequence[dict[str, Any]] | None = None,
          args: dict[str, Any] | None = None) -> Prompt:
    """Render ``messages`` (with ``tools``, for a template that renders them, and the
    request's template ``args``) and cut the rendering into pieces.  ``media_at``: for each message, where in its text a media
    part's ``marker`` sits (in order).  Raises TemplateError (the template), TextRefused,
    or MediaInputError when the rendering does not hold each media part exactly once."""
    text = template.render(messages, tools=tools, args=args)
    contents = [m["content"] for m in messages]
    at = list(media_at) or [()] * len(messages)
    layout = _placeholder_layout(template, messages, tools, args)
    if layout is not None and _joined(layout, contents) == text:
        return _prompt(text, layout, contents, at, marker, Method.PLACEHOLDERS)
    located = _verbatim_layout(text, contents)
    if (located is not None and layout is not None
            and _controls(located, specials) == _controls(layout, specials)):
        return _prompt(text, located, contents, at, marker, Method.VERBATIM)
    n_media = sum(len(a) for a in at)
    for i, content in enumerate(contents):
        texts = _texts(content, at[i], marker)
        if any(specials(t) or (n_media and marker in t) for t in texts):
            raise TextRefused(i)
    if not n_media:
        return Prompt(text, (Piece(Kind.MARKUP, text),) if text else (), Method.WHOLE)
    parts = text.split(marker)
    if len(parts) != n_media + 1:
        raise MediaInputError("the prompt's media markers do not match its media parts")
    pieces = [Piece(Kind.MARKUP, parts[0])]
    for k, part in enumerate(parts[1:]):
        pieces += [Piece(Kind.MEDIA, media=k), Piece(Kind.MARKUP, part)]
    return Prompt(text, tuple(p for p in pieces if p.text or p.kind is Kind.MEDIA),
                  Method.WHOLE)


def raw(text: str) -> Prompt:
    """A completion's prompt, not wrapped in the chat template: one piece of text, so a
    special-token text in it is tokenized as the characters it is (as a message's text)."""
    return Prompt(text, (Piece(Kind.TEXT, text),) if text else (), Method.RAW)


def markup(text: str) -> Prompt:
    """A raw text tokenized as markup: its special-token texts become those tokens
    (/tokenize's ``parse_special``)."""
    return Prompt(text, (Piece(Kind.MARKUP, text),) if text else (), Method.RAW)


def has_fields(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether a message holds tool fields beside its role and content."""
    return any(len(m) > 2 for m in messages)


def _placeholder_layout(template: ChatTemplate, messages: Sequence[dict[str, Any]],
                        tools: Sequence[dict[str, Any]] | None,
                        args: dict[str, Any] | None = None) -> Layout | None:
    """The template's rendering with each text a placeholder, as markup and message
    numbers; None when the template does not render the placeholders.  Without tools it
    depends on the roles alone (and on which texts are empty), so it is cached by those:
    one render per request, not two.  Tools, tool fields and template arguments are
    markup: rendered again."""
    if tools or args or has_fields(messages):
        return _layout(template, [(m["role"], bool(m["content"])) for m in messages],
                       [{k: v for k, v in m.items() if k not in ("role", "content")}
                        for m in messages], tools, args)
    return _shape_layout(template, tuple((m["role"], bool(m["content"])) for m in messages))


@functools.lru_cache(maxsize=LAYOUTS)
def _shape_layout(template: ChatTemplate, shape: tuple[tuple[str, bool], ...]) -> Layout | None:
    return _layout(template, shape, [{}] * len(shape), None)


def _layout(template: ChatTemplate, shape: Sequence[tuple[str, bool]],
            extras: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
            args: dict[str, Any] | None = None) -> Layout | None:
    nonce = secrets.token_hex(8)
    # An empty text stays empty: a template may test for one (``if content``).
    stand_in = [{"role": role, "content": f"<<{nonce}:{i}>>" if filled else "", **extra}
                for i, ((role, filled), extra) in enumerate(zip(shape, extras, strict=True))]
    try:
        rendered = template.render(stand_in, tools=tools, args=args)
    except TemplateError:
        return None
    head, *rest = rendered.split(f"<<{nonce}:")
    layout: list[str | int] = [head] if head else []
    for part in rest:  # "3>>markup..."
        number, sep, markup = part.partition(">>")
        if not sep or not number.isdigit() or int(number) >= len(shape):
            return None  # the template cut a placeholder
        layout.append(int(number))
        if markup:
            layout.append(markup)
    return tuple(layout)


def _joined(layout: Layout, contents: Sequence[str]) -> str:
    return "".join(p if isinstance(p, str) else contents[p] for p in layout)


def _verbatim_layout(text: str, contents: Sequence[str]) -> Layout | None:
    """Each non-empty text found whole, in order, in the rendering; None if one is not."""
    layout: list[str | int] = []
    pos = 0
    for i, content in enumerate(contents):
        if not content:
            continue
        found = text.find(content, pos)
        if found < 0:
            return None
        if found > pos:
            layout.append(text[pos:found])
        layout.append(i)
        pos = found + len(content)
    if pos < len(text):
        layout.append(text[pos:])
    return tuple(layout)


def _controls(layout: Layout, specials: Specials) -> list[int]:
    """The special tokens of a layout's markup, in order."""
    return [t for p in layout if isinstance(p, str) for t in specials(p)]


def _texts(content: str, at: Sequence[int], marker: str) -> list[str]:
    """A message's text without its media parts' markers."""
    out, pos = [], 0
    for a in at:
        out.append(content[pos:a])
        pos = a + len(marker)
    out.append(content[pos:])
    return out


def _prompt(text: str, layout: Layout, contents: Sequence[str], at: Sequence[Sequence[int]],
            marker: str, method: Method) -> Prompt:
    """The pieces of a layout: its markup, and each message's text cut at its media."""
    if not any(at):
        return Prompt(text, tuple(Piece(Kind.MARKUP, p) if isinstance(p, str)
                                  else Piece(Kind.TEXT, contents[p]) for p in layout), method)
    first = [sum(len(a) for a in at[:i]) for i in range(len(at))]  # a message's first part
    pieces: list[Piece] = []
    for p in layout:
        if isinstance(p, str):
            pieces.append(Piece(Kind.MARKUP, p))
            continue
        for k, t in enumerate(_texts(contents[p], at[p], marker)):
            if k:
                pieces.append(Piece(Kind.MEDIA, media=first[p] + k - 1))
            if t:
                pieces.append(Piece(Kind.TEXT, t))
    placed = sorted(p.media for p in pieces if p.kind is Kind.MEDIA)
    if placed != list(range(sum(len(a) for a in at))):  # a part left out, or put twice
        raise MediaInputError("the prompt's media markers do not match its media parts")
    return Prompt(text, tuple(pieces), method)


class Pieces(Protocol):
    """What tokenizing a rendered prompt needs of an engine: llama.cpp's vocabulary
    (engine/llama.py) or a Hugging Face tokenizer's (engine/hfvocab.py)."""

    def tokenize_pieces(self, pieces: Sequence[tuple[str, bool]], add_special: bool = True,
                        start: bool = True, end: bool = True) -> list[int]: ...


def text_tokens(engine: Pieces, prompt: Prompt, add_special: bool) -> list[int]:
    """The tokens of a prompt without media."""
    return engine.tokenize_pieces([(p.text, p.kind is Kind.MARKUP) for p in prompt.pieces],
                                  add_special)


def media_tokens(engine: Pieces, encoder: MediaTokenizer, prompt: Prompt,
                 media: Sequence[tuple[str, bytes]],
                 add_special: bool) -> tuple[list[int], list[MediaSegment]]:
    """The tokens (with placeholders) and segments of a prompt with media: the text
    between two media parts tokenized here, each part by the projector (libmtmd tokenizes
    text between markers on its own too).  The caller owns the segments."""
    encoder.check(media)
    tokens: list[int] = []
    segments: list[MediaSegment] = []
    run: list[tuple[str, bool]] = []
    first = True
    try:
        for p in prompt.pieces:
            if p.kind is not Kind.MEDIA:
                run.append((p.text, p.kind is Kind.MARKUP))
                continue
            tokens += engine.tokenize_pieces(run, add_special, start=first, end=False)
            run, first = [], False
            kind, data = media[p.media]
            part, segs = encoder.tokenize_media(kind, data, p.media)
            for seg in segs:
                seg.start += len(tokens)
            segments += segs
            tokens += part
        tokens += engine.tokenize_pieces(run, add_special, start=first, end=True)
    except BaseException:
        release_all(segments)
        raise
    return tokens, segments
