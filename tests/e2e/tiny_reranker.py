#!/usr/bin/env python3
"""Build a tiny BERT cross-encoder ("reranker") GGUF whose weights are set by hand, so that
its score means something: the more of the input's words occur twice (in the query and in
the document), the higher the score.

For tests only.  Random weights cannot rank; these compute lexical overlap with real
attention, layer norms and llama.cpp's rank pooling (its ``cls`` and ``cls.output``
head), so a test can check that a relevant document is ranked above an irrelevant one
through the whole path: the models file's ``kind = "rerank"``, llama.cpp's RANK pooling
and ``/v1/rerank``.

    python tiny_reranker.py OUT.gguf
    python tiny_reranker.py --hf FOLDER    # the same model for vLLM (build_hf)

The residual stream is one-hot: a dimension per word of the vocabulary, one for the
other special tokens, one marking ``[CLS]``, one per position, and three more (A, B, R).
Every layer norm's weight and bias undo its normalization for a vector of that shape, so
the stream goes through them (almost) unchanged.

* Layer 1 (attention, one head): a word attends to another place holding the same word
  (score beta), else to ``[CLS]`` (beta/2); its own place scores 0 (the position term
  cancels the word term).  The value of a word is 1 in A, that of ``[CLS]`` 1 in B: so
  A is about 1 for a word that occurs twice in the input, else about 0.
* Layer 2 (attention, uniform): R = the mean of A over the input, on every row.
* Rank pooling on the ``[CLS]`` row: score = tanh(K * (R - C)) (``cls``, then
  ``cls.output`` picks it).

The GGUF needs only numpy and the `gguf` package; the Hugging Face copy, torch,
transformers and tokenizers.  Output is deterministic.
"""

from __future__ import annotations

import math
import sys

import numpy as np

try:
    import gguf
except ImportError:  # pragma: no cover (the --hf copy is built without it)
    gguf = None

#: The vocabulary's words (WordPiece, lower case); any other word is [UNK].
WORDS = """
a an the of in on at to is are was be and or not what which who where when how why do does
it its this that these those for with by from as than then there here some many much more
paris france capital city country river seine germany berlin rome italy spain madrid
banana bananas apple fruit yellow red green rich potassium vitamin sweet
cat cats dog dogs animal pet pets sleep sleeps run runs fast
water ocean sea blue sky sun moon star stars planet earth mars space
python code program language computer software bug test tests server model models
? . , ! ' -
""".split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CONTEXT = 512  # positions (the default embedding context of a models file entry)
TYPE_A = 0.1  # the Hugging Face copy's token type 1 in A (build_hf)
HF_CONTEXT = 128  # the Hugging Face copy's: one head of 256 (vLLM's CPU attention: <= 512)
BETA = 24.0  # the attention's sharpness: e^(beta/2) against the input's length
K, C = 4.0, 0.25  # score = tanh(K * (R - C))
EPS = 1e-12


def layout(context: int = CONTEXT) -> dict[str, int]:
    """Where each kind of dimension starts, and the model's width, for ``context``
    positions."""
    w = len(WORDS)
    at = {"special": w, "cls": w + 1, "pos": w + 2, "context": context}
    at["A"], at["B"], at["R"], at["sink"] = (w + 2 + context + i for i in range(4))
    at["width"] = -(-(at["sink"] + 1) // 32) * 32
    return at


def tensors(context: int = CONTEXT) -> dict[str, np.ndarray]:
    """The model's tensors in llama.cpp's names (numpy shapes: rows are a matrix's
    outputs)."""
    at = layout(context)
    n = at["context"]
    d, w = at["width"], len(WORDS)
    s = math.sqrt(d)  # llama.cpp scales scores by 1/sqrt(head width); one head of d

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, np.float32)

    emb = zeros(len(SPECIALS) + w, d)
    for i in range(len(SPECIALS)):
        emb[i, at["cls"] if SPECIALS[i] == "[CLS]" else at["special"]] = 1
    for t in range(w):
        emb[len(SPECIALS) + t, t] = 1
    pos = zeros(n, d)
    pos[np.arange(n), at["pos"] + np.arange(n)] = 1

    def norm(ones: float) -> dict[str, np.ndarray]:
        # undo the norm of a vector of d values, ``ones`` of them 1 and the rest 0
        mean = ones / d
        std = math.sqrt(ones / d - mean * mean + EPS)
        return {"weight": np.full(d, std, np.float32), "bias": np.full(d, mean, np.float32)}

    out = {"token_embd.weight": emb, "token_types.weight": zeros(2, d),
           "position_embd.weight": pos}
    out.update({f"token_embd_norm.{k}": v for k, v in norm(2).items()})
    layers = [_match_layer(at, s), _mean_layer(at)]
    for i, layer in enumerate(layers):
        for name, value in layer.items():
            out[f"blk.{i}.{name}"] = value
        out.update({f"blk.{i}.attn_output_norm.{k}": v for k, v in norm(3).items()})
        out.update({f"blk.{i}.layer_output_norm.{k}": v for k, v in norm(3).items()})
        out[f"blk.{i}.ffn_up.weight"] = zeros(4, d)  # no feed-forward: GELU(0) = 0
        out[f"blk.{i}.ffn_down.weight"] = zeros(d, 4)
    cls, cls_b = zeros(d, d), zeros(d)
    cls[0, at["R"]], cls_b[0] = K, -K * C
    head = zeros(1, d)
    head[0, 0] = 1.0
    out.update({"cls.weight": cls, "cls.bias": cls_b, "cls.output.weight": head})
    return out


def _match_layer(at: dict[str, int], s: float) -> dict[str, np.ndarray]:
    """Layer 1: A = 1 where a word occurs twice, B = 1 where it does not."""
    d, w = at["width"], len(WORDS)
    q, k, v, o = (np.zeros((d, d), np.float32) for _ in range(4))
    qb = np.zeros(d, np.float32)
    words, places = np.arange(w), at["pos"] + np.arange(at["context"])
    q[words, words], k[words, words] = BETA * s, 1.0  # the same word elsewhere: beta
    q[places, places], k[places, places] = -BETA * s, 1.0  # its own place: minus beta
    qb[at["sink"]], k[at["sink"], at["cls"]] = BETA / 2 * s, 1.0  # [CLS]: beta / 2
    v[at["A"], words], v[at["B"], at["cls"]] = 1.0, 1.0
    o[at["A"], at["A"]], o[at["B"], at["B"]] = 1.0, 1.0
    return {"attn_q.weight": q, "attn_q.bias": qb, "attn_k.weight": k, "attn_v.weight": v,
            "attn_output.weight": o}


def _mean_layer(at: dict[str, int]) -> dict[str, np.ndarray]:
    """Layer 2: every row attends to all alike; R = the mean of A."""
    d = at["width"]
    q, k, v, o = (np.zeros((d, d), np.float32) for _ in range(4))
    v[at["R"], at["A"]], o[at["R"], at["R"]] = 1.0, 1.0
    return {"attn_q.weight": q, "attn_k.weight": k, "attn_v.weight": v,
            "attn_output.weight": o}


#: llama.cpp's tensor names (tensors()) and Hugging Face's BertForSequenceClassification's
HF_NAMES = (("token_embd.", "bert.embeddings.word_embeddings."),
            ("position_embd.", "bert.embeddings.position_embeddings."),
            ("token_types.", "bert.embeddings.token_type_embeddings."),
            ("token_embd_norm.", "bert.embeddings.LayerNorm."),
            ("attn_q.", "attention.self.query."), ("attn_k.", "attention.self.key."),
            ("attn_v.", "attention.self.value."),
            ("attn_output_norm.", "attention.output.LayerNorm."),
            ("attn_output.", "attention.output.dense."), ("ffn_up.", "intermediate.dense."),
            ("ffn_down.", "output.dense."), ("layer_output_norm.", "output.LayerNorm."),
            ("cls.output.", "classifier."), ("cls.", "bert.pooler.dense."))


def hf_name(name: str) -> str:
    layer = ""
    if name.startswith("blk."):
        _, n, name = name.split(".", 2)
        layer = f"bert.encoder.layer.{n}."
    for ours, theirs in HF_NAMES:
        if name.startswith(ours):
            return layer + theirs + name[len(ours):]
    raise KeyError(name)


def build_hf(folder: str) -> None:
    """The same model, of :data:`HF_CONTEXT` positions, as a Hugging Face
    ``BertForSequenceClassification`` folder with its WordPiece tokenizer (a query and a
    document: ``[CLS] query [SEP] document [SEP]``), for vLLM.  Needs torch, transformers
    and tokenizers (the vLLM venv)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.decoder = decoders.WordPiece()
    BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                      pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                      model_max_length=HF_CONTEXT).save_pretrained(folder)
    at = layout(HF_CONTEXT)
    config = BertConfig(vocab_size=len(vocab), hidden_size=at["width"], num_hidden_layers=2,
                        num_attention_heads=1, intermediate_size=4,
                        max_position_embeddings=HF_CONTEXT, type_vocab_size=2,
                        layer_norm_eps=EPS, num_labels=1, hidden_act="gelu")
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # (the biases llama.cpp's file leaves out)
        own = model.state_dict()
        for name, value in tensors(HF_CONTEXT).items():
            own[hf_name(name)].copy_(torch.from_numpy(value))
        # A document's tokens (token type 1) carry TYPE_A in A: this copy reads token
        # types (llama.cpp's BERT adds type 0's row alone), so a test sees them arrive.
        own["bert.embeddings.token_type_embeddings.weight"][1, at["A"]] = TYPE_A
    model.save_pretrained(folder)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--hf":
        build_hf(args[1])
        return
    if len(args) != 1:
        sys.exit(f"usage: {sys.argv[0]} OUT.gguf | --hf FOLDER")
    if gguf is None:
        sys.exit("the `gguf` package is required: pip install gguf")
    at = layout()
    writer = gguf.GGUFWriter(args[0], arch="bert")
    writer.add_string("general.name", "tiny-lexical-reranker")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(at["width"])
    writer.add_feed_forward_length(4)
    writer.add_block_count(2)
    writer.add_head_count(1)
    writer.add_layer_norm_eps(EPS)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_token_type_count(2)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(SPECIALS + ["\u2581" + x for x in WORDS])
    writer.add_token_types([gguf.TokenType.UNKNOWN if x == "[UNK]" else gguf.TokenType.CONTROL
                            for x in SPECIALS] + [gguf.TokenType.NORMAL] * len(WORDS))
    for key, name in (("pad", "[PAD]"), ("unk", "[UNK]"), ("bos", "[CLS]"),
                      ("sep", "[SEP]"), ("mask", "[MASK]")):
        getattr(writer, f"add_{key}_token_id")(SPECIALS.index(name))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_sep_token(True)
    for name, value in tensors().items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
