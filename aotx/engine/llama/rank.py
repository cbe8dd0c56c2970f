"""A reranker's input: a query and a document joined as llama-server joins them.

A reranker (a cross-encoder) scores one input that holds both texts.  Its GGUF may carry
the way to join them (``tokenizer.chat_template.rerank``, with ``{query}`` and
``{document}``, as Qwen 3's rerankers do); else the vocabulary's own special tokens
join them: BOS, the query, EOS, SEP, the document, EOS, each where the vocabulary adds
it (a BERT vocabulary: ``[CLS] query [SEP] document``; EOS is SEP where there is none).
Unlike llama-server, the two texts are a message's text: special-token texts in them
stay text, so a document cannot end its part of the input early.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import llama_cpp

if TYPE_CHECKING:
    from .engine import LlamaEngine

_SLOTS = re.compile(r"(\{query\}|\{document\})")


def rank_prompt(engine: LlamaEngine, query: str, document: str) -> list[int]:
    """The tokens of the reranker's input for ``query`` and ``document``."""
    template = engine.metadata("tokenizer.chat_template.rerank")
    if template is not None:
        texts = {"{query}": query, "{document}": document}
        return engine.tokenize_pieces([(texts.get(p, p), p not in texts)
                                       for p in _SLOTS.split(template) if p],
                                      add_special=False)
    v = engine.vocab
    sep = int(llama_cpp.llama_vocab_sep(v))
    end = [engine.eos if engine.eos >= 0 else sep] if engine.add_eos else []
    out = [engine.bos] if engine.add_bos else []
    out += engine.tokenize_pieces([(query, False)], add_special=False) + end
    out += [sep] if llama_cpp.llama_vocab_get_add_sep(v) else []
    return out + engine.tokenize_pieces([(document, False)], add_special=False) + end
