"""``LlamaEngine.tokenize_pieces`` without a model: its splitting and its runs, with a
vocabulary of three special tokens and a token a byte (the real vocabulary's result is
checked against llama.cpp in tests/e2e/test_engine.py)."""

from __future__ import annotations

import functools

from aotx.engine.llama.engine import LlamaEngine

USER, END, MASK = 1, 2, 3


def engine(lstrip: frozenset[int] = frozenset(),
           rstrip: frozenset[int] = frozenset()) -> LlamaEngine:
    eng = LlamaEngine.__new__(LlamaEngine)  # no model: only what tokenizing uses
    eng._specials = [(b"<|user|>", USER), (b"<mask>", MASK), (b"<|end|>", END)]
    eng._lstrip, eng._rstrip = lstrip, rstrip
    eng.add_bos, eng.add_eos, eng.bos, eng.eos = True, False, 1000, 1001
    eng._fragment = eng._tokenize_text = lambda data: tuple(data)  # type: ignore[method-assign]
    eng._markup_cached = functools.lru_cache(maxsize=8)(eng._split_specials)
    return eng


def text(tokens: list[int]) -> str:
    return "".join(f"[{t}]" if t in (USER, END, MASK) else chr(t) for t in tokens)


def test_special_texts_are_tokens_in_markup_and_text_elsewhere() -> None:
    eng = engine()
    got = eng.tokenize_pieces([("<|user|>\n", True), ("hi<|end|><mask>", False),
                               ("<|end|>\n", True)], add_special=False)
    assert text(got) == "[1]\nhi<|end|><mask>[2]\n"
    assert eng.specials("<|user|>x<|end|>") == [USER, END]
    # the BOS opens the prompt only where the pieces start it
    assert eng.tokenize_pieces([("a", False)])[0] == 1000
    assert eng.tokenize_pieces([("a", False)], start=False) == [ord("a")]


def test_a_special_text_across_two_pieces_is_text() -> None:
    eng = engine()
    got = eng.tokenize_pieces([("<|us", True), ("er|>", True)], add_special=False)
    assert text(got) == "<|user|>"


def test_strip_tokens_take_the_whitespace_of_the_run_beside_them() -> None:
    """As llama.cpp: an RSTRIP token (all of Phi-3's) eats the whitespace after it, also
    where the run goes on into a message's text; an LSTRIP token the whitespace before."""
    eng = engine(lstrip=frozenset({MASK}), rstrip=frozenset({USER}))
    got = eng.tokenize_pieces([("<|user|>\n", True), ("  hi  ", False), ("<mask>", True),
                               ("<|end|> x", True)], add_special=False)
    assert text(got) == "[1]hi[3][2] x"


def test_a_rerank_template_takes_the_query_and_document_as_text() -> None:
    """A GGUF's ``tokenizer.chat_template.rerank`` (Qwen 3's rerankers): its markup's special
    texts are tokens, the query's and the document's are text; no BOS is added."""
    eng = engine()
    eng.metadata = lambda key: (  # type: ignore[method-assign]
        "<|user|>q:{query}|d:{document}<|end|>" if key == "tokenizer.chat_template.rerank"
        else None)
    got = eng.rank_prompt("<|end|>why", "<mask>")
    assert text(got) == "[1]q:<|end|>why|d:<mask>[2]"
