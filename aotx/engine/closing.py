"""A think block's budget, kept by forcing its closing (llama.cpp's engine, whose masks
aotx fills).

A constrained request of a thinking model has its constraint after a think block of at
most a budget of tokens (device/constraints.py).  The grammar's thought is a lazy lexeme
with the closing as its ``suffix``: the model closes the block itself at any tokenization
of the closing.  (The closing as a ``stop``, then again as text, made llguidance 1.9.1
panic computing the mask, "num_rows=3 row_infos=2", once the model had written the
closing up to its last token, ``</think`` before ``>``: every such request failed.)
llguidance's own ``max_tokens`` ends a lexeme without its suffix, so the budget is kept
here instead: once the block (from its opening) has taken its tokens, and any character
the model left unfinished is whole, the matcher allows only the closing's tokens, one a
step, which the lexeme then ends on.  An engine that applies the grammar itself (vLLM)
keeps the ``stop`` form, whose ``max_tokens`` llguidance closes.
"""

from __future__ import annotations

from collections.abc import Callable

from .output import begun_length, utf8_complete_length


class Closing:
    """Where a think block's budget stands: tokens left, the last bytes (where the
    opening and the closing would show), and the closing's tokens still to force."""

    __slots__ = ("tag", "opening", "left", "tail", "forced", "tokenize", "piece")

    def __init__(self, tag: bytes, budget: int, tokenize: Callable[[bytes], list[int]],
                 piece: Callable[[int], bytes], opening: bytes = b"") -> None:
        self.tag = tag
        self.opening = opening  # b"": the block is open (the prompt opened it, or it began)
        self.left = budget  # tokens the block may still take; -1: it is closed
        self.tail = b""
        self.forced: list[int] = []
        self.tokenize = tokenize  # a text's tokens, without special parsing
        self.piece = piece  # a token's bytes

    @property
    def next(self) -> int | None:
        """The token the next step must sample, or None (the grammar's mask applies)."""
        return self.forced[0] if self.forced else None

    def passed(self, token: int) -> None:
        """``token`` was sampled (and the grammar took it)."""
        if self.left < 0:
            return
        piece = self.piece(token)
        keep = max(len(self.tag), len(self.opening), 4) - 1 + len(piece)
        self.tail = (self.tail + piece)[-keep:]
        if self.forced:
            if token == self.forced[0]:
                self.forced.pop(0)
                if not self.forced:
                    self.left = -1
                return
            # (another token came, as a sampler may give when the forced one's logit is
            # -inf: the closing is forced again from where the text now ends)
            self.forced = []
        if self.opening:  # (the opening's tokens are not the thought's)
            at = self.tail.find(self.opening)
            if at < 0:
                return
            self.tail, self.opening = self.tail[at + len(self.opening):], b""
            if not self.tail:
                return
        if self.tag in self.tail:  # the model closed it
            self.left = -1
            return
        self.left = max(0, self.left - 1)
        # (a wait for a character's end lasts while tokens end inside one: a few at most
        # in practice, the budget then a few tokens over)
        if self.left == 0 and utf8_complete_length(self.tail) == len(self.tail):
            self.forced = self.tokenize(self.tag[begun_length(self.tail, self.tag):])
            if not self.forced:
                self.left = -1

