"""The llama.cpp engine: a GGUF model in one llama.cpp context (``engine``), its sampler
chain (``sampling``), continuous batching over its sequences (``scheduler``, with the
prompt-cache and KV bookkeeping of ``kvpool``, ``spill``, ``chunking`` and
``residency``), and its embedding contexts (``embedder``, ``embed_pieces``).

Only this package and the multimodal encoder import ``llama_cpp``: a device that serves
vLLM models alone never loads it.
"""
