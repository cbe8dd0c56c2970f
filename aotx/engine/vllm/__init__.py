"""The vLLM engine: a model vLLM's ``AsyncLLM`` serves, behind the same contract as
llama.cpp's (``runner``: requests, tokens to bytes, abort, health; ``inputs``: embeddings
and media; ``hfvocab``: the Hugging Face tokenizer the device tokenizes with).

vLLM itself is imported when such a model starts, never at import.
"""
