"""A Hugging Face tokenizer seen as the device sees llama.cpp's vocabulary.

The device renders chat templates, tokenizes prompts, checks special-token text and
turns sampled tokens into bytes itself, whatever engine decodes (engine/vllm.py): the
byte cursors and stop strings stay aotx's.  :class:`HfVocab` gives a vLLM model the
part of :class:`~aotx.engine.llama.LlamaEngine`'s surface that does this, over a
:class:`Vocab`: the Hugging Face tokenizer's (:func:`from_hf`), or a scripted one in
unit tests.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Distinct runs of text whose tokens are cached (a chat prompt's fixed pieces).
RUN_CACHE = 1024


@dataclass(frozen=True)
class Vocab:
    """What a tokenizer must say: its size, its special tokens (text and id), which ids
    end a generation, the beginning-of-sequence id and whether prompts start with it,
    the chat template, how a run of text tokenizes with no special parsing, and the
    exact bytes of each token."""

    n_vocab: int
    specials: tuple[tuple[str, int], ...]
    eog: frozenset[int]
    bos: int
    add_bos: bool
    chat_template: str | None
    encode: Callable[[str], list[int]]
    token_bytes: Callable[[int], bytes]
    grammar_tokenizer: Any = None  # llguidance's LLTokenizer (constraints: grammar.py)
    pair: Callable[[str, str], list[int]] | None = None  # a query and a document joined
    second_after: int = -1  # the token whose first place ends a pair's first segment


class HfVocab:
    """Prompt-side engine surface for a model another engine decodes."""

    def __init__(self, vocab: Vocab, context: int) -> None:
        self.vocab = vocab
        self.n_vocab = vocab.n_vocab
        self.add_bos = vocab.add_bos
        self.bos = vocab.bos
        self.eos = min(vocab.eog) if vocab.eog else -1
        self.slot_context = context
        # one pattern, longest first ("<|im_start|>" before "<|im"): a message is scanned
        # once, however many special tokens the vocabulary has (Llama 3: 256)
        ordered = sorted(vocab.specials, key=lambda s: -len(s[0]))
        self._special_id = {text: token for text, token in reversed(ordered)}
        self._pattern = (re.compile("|".join(re.escape(text) for text, _ in ordered))
                         if ordered else None)
        self.special_ids = frozenset(t for _, t in vocab.specials)
        self._special_text = {t: text.encode("utf-8") for text, t in reversed(vocab.specials)}
        self._run = functools.lru_cache(maxsize=RUN_CACHE)(vocab.encode)
        self._pieces: dict[int, bytes] = {}

    def metadata(self, key: str) -> str | None:
        return self.vocab.chat_template if key == "tokenizer.chat_template" else None

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes, a special token's text included."""
        special = self._special_text.get(token)
        return special if special is not None else self.piece(token)

    def piece(self, token: int) -> bytes:
        """The exact bytes of one token; a special token is no text."""
        found = self._pieces.get(token)
        if found is None:
            found = b"" if token in self.special_ids else self.vocab.token_bytes(token)
            self._pieces[token] = found
        return found

    def is_eog(self, token: int) -> bool:
        return token in self.vocab.eog

    def specials(self, text: str) -> list[int]:
        """The special tokens that special parsing finds in ``text``, in order."""
        return [p for p in self._split(text) if isinstance(p, int)]

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenize_pieces([(text, True)], add_special)

    def rank_prompt(self, query: str, document: str) -> list[int]:
        """A reranker's input: ``query`` and ``document`` joined as the tokenizer joins a
        pair (BERT's ``[CLS] query [SEP] document [SEP]``), as vLLM's own scoring does.
        Special-token texts in either stay text."""
        if self.vocab.pair is None:
            raise NotImplementedError("this tokenizer joins no pair")
        return self.vocab.pair(query, document)

    def second_segment(self, tokens: Sequence[int]) -> int | None:
        """Where a pair's second segment starts in ``tokens`` (its token type 1, as the
        tokenizer marks it), or None when the tokenizer gives no token types."""
        if self.vocab.second_after < 0:
            return None
        try:
            return tokens.index(self.vocab.second_after) + 1
        except ValueError:
            return None

    def tokenize_pieces(self, pieces: Sequence[tuple[str, bool]], add_special: bool = True,
                        start: bool = True, end: bool = True) -> list[int]:
        """As :meth:`LlamaEngine.tokenize_pieces`: special-token texts are parsed only
        in the pieces marked True (the template's markup); the text between two special
        tokens is one run, tokenized with no special parsing."""
        runs: list[str | int] = []
        text: list[str] = []
        for piece, markup in pieces:
            for part in self._split(piece) if markup else (piece,):
                if isinstance(part, int):
                    runs += ("".join(text), part)
                    text = []
                else:
                    text.append(part)
        runs.append("".join(text))
        out = [self.bos] if add_special and start and self.add_bos else []
        for run in runs:
            if isinstance(run, int):
                out.append(run)
            elif run:
                out += self._run(run)
        return out

    def _split(self, text: str) -> list[str | int]:
        """``text`` as runs of text and special tokens (longest special text first)."""
        if self._pattern is None:
            return [text] if text else []
        out: list[str | int] = []
        start = 0
        for found in self._pattern.finditer(text):
            out += (text[start:found.start()], self._special_id[found.group()])
            start = found.end()
        out.append(text[start:])
        return [p for p in out if p != ""]


def from_hf(tokenizer: Any, grammar: bool = True) -> Vocab:
    """The :class:`Vocab` of a Hugging Face tokenizer (as vLLM loads it).  Token bytes
    come from llguidance's reading of the same tokenizer, which knows byte-level BPE,
    SentencePiece byte fallback and the rest.  A model that needs no ``grammar`` (a
    pooling model) may have a tokenizer llguidance cannot read (BERT's WordPiece): its
    token bytes are then the tokenizer's decoding of each token."""
    from llguidance.hf import from_tokenizer

    try:
        ll = from_tokenizer(tokenizer)
    except ValueError:  # ("can't determine decoder type: WordPiece")
        if grammar:
            raise
        ll = None
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = tuple((tok.content, int(i)) for i, tok in added.items()
                     if getattr(tok, "special", False) and tok.content)
    eog = {int(t) for t in (ll.eos_tokens if ll is not None else ())} | (
        {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set())
    bos = tokenizer.bos_token_id
    probe = tokenizer("a").input_ids  # whether the tokenizer itself starts with BOS
    types = tokenizer("a", "b").get("token_type_ids") or []
    sep = tokenizer.sep_token_id
    return Vocab(
        n_vocab=int(ll.vocab_size) if ll is not None else len(tokenizer), specials=specials,
        eog=frozenset(eog), bos=int(bos) if bos is not None else -1,
        add_bos=bos is not None and bool(probe) and probe[0] == bos,
        chat_template=getattr(tokenizer, "chat_template", None),
        encode=lambda text: list(tokenizer(text, add_special_tokens=False,
                                           split_special_tokens=True).input_ids),
        token_bytes=((lambda t: bytes(ll.decode_bytes([t]))) if ll is not None
                     else (lambda t: tokenizer.decode([t]).encode("utf-8"))),
        grammar_tokenizer=ll,
        pair=lambda q, d: list(tokenizer(q, d, split_special_tokens=True).input_ids),
        second_after=int(sep) if 1 in types and sep is not None else -1)
