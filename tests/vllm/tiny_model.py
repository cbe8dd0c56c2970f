"""Build a tiny random Llama and its BPE tokenizer (trained here) in a folder that vLLM
loads: ``python tiny_model.py FOLDER``.  Runs in the vLLM venv (transformers, torch).

Two layers, two heads of 64 (vLLM's CPU attention takes no head size under 32), a
byte-level vocabulary of a few hundred tokens with ChatML specials and a ChatML template;
float32, fixed seed: the same weights every time."""

from __future__ import annotations

import sys

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def build(folder: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Hello, world: "
                             "héllo wörld, 你好 🙂 {\"a\": 1}."] * 50, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                 eos_token="<|eos|>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(hf), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=hf.bos_token_id,
                         eos_token_id=hf.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)


if __name__ == "__main__":
    build(sys.argv[1])
