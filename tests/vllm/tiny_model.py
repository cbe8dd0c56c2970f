"""Build a tiny random Llama and its BPE tokenizer (trained here) in a folder that vLLM
loads, and random LoRA adapters for it: ``python tiny_model.py FOLDER [ADAPTER ...]``;
or a tiny random Idefics3 (a SigLIP vision tower of 32x32 pixels, 4 image positions, on
the same kind of Llama) with its processor: ``python tiny_model.py --vision FOLDER``; or
a tiny random Qwen2-Audio: ``python tiny_model.py --audio FOLDER``.
Runs in the vLLM venv (transformers, torch, safetensors).

Two layers, two heads of 64 (vLLM's CPU attention takes no head size under 32), a
byte-level vocabulary of a few hundred tokens with ChatML specials and a ChatML template;
float32, fixed seed: the same weights every time."""

from __future__ import annotations

import sys
from typing import Any

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def tokenizer(extra: tuple[str, ...] = ()) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", *extra],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Hello, world: "
                             "héllo wörld, 你好 🙂 {\"a\": 1}."] * 50, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                 eos_token="<|eos|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def llama_config(hf: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(hf), hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=1024, bos_token_id=hf.bos_token_id,
                       eos_token_id=hf.eos_token_id, tie_word_embeddings=False)


def build(folder: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    hf = tokenizer()
    hf.save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(hf)).save_pretrained(folder)


def build_vision(folder: str) -> None:
    """Idefics3 (SigLIP, pixel shuffle, Llama): one 32x32 image without splitting is 4
    image positions between its markers.  (vLLM's LLaVA needs torchvision, which the
    CPU venv cannot have: scripts/setup-vllm.)"""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    hf = tokenizer(("<image>", "<fake_token_around_image>", "<global-img>",
                    "<end_of_utterance>"))
    torch.manual_seed(0)
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=32, patch_size=8)
    config = Idefics3Config(vision_config=vision.to_dict(),
                            text_config=llama_config(hf).to_dict(), scale_factor=2,
                            image_token_id=hf.convert_tokens_to_ids("<image>"),
                            tie_word_embeddings=False, pad_token_id=None)
    Idefics3ForConditionalGeneration(config).save_pretrained(folder)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 32},
                                       max_image_size={"longest_edge": 32})
    Idefics3Processor(image_processor=images, tokenizer=hf, image_seq_len=4,
                      chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    hf.save_pretrained(folder)


def build_audio(folder: str) -> None:
    """Qwen2-Audio (a one-layer Whisper-style encoder, Qwen2): a second of 16 kHz audio
    is 25 audio positions."""
    import os

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        Qwen2Config,
        WhisperFeatureExtractor,
    )

    hf = tokenizer(("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"))
    torch.manual_seed(0)
    encoder = Qwen2AudioEncoderConfig(d_model=64, encoder_layers=1, encoder_attention_heads=2,
                                      encoder_ffn_dim=128, num_mel_bins=128)
    text = Qwen2Config(vocab_size=len(hf), hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=2048, bos_token_id=hf.bos_token_id,
                       eos_token_id=hf.eos_token_id, tie_word_embeddings=False)
    config = Qwen2AudioConfig(audio_config=encoder.to_dict(), text_config=text.to_dict(),
                              audio_token_index=hf.convert_tokens_to_ids("<|AUDIO|>"))
    Qwen2AudioForConditionalGeneration(config).save_pretrained(folder)
    # transformers 5 writes the language model as language_model.model.model.*, which
    # vLLM 0.32 does not map: the names it reads
    path = os.path.join(folder, "model.safetensors")
    tensors = {k.replace("language_model.model.model.", "language_model.model."): v
               for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128),
                        tokenizer=hf, chat_template=CHAT_TEMPLATE, audio_token="<|AUDIO|>",
                        audio_bos_token="<|audio_bos|>",
                        audio_eos_token="<|audio_eos|>").save_pretrained(folder)
    hf.save_pretrained(folder)


def adapter(folder: str, base: str, seed: int, rank: int = 8) -> None:
    """A LoRA adapter (PEFT's layout) on the attention's q and v projections of both
    layers, with random A and B (B is zero in a fresh adapter: here it moves the output)."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 128) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(128, rank) * 0.5
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                   "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
                   "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": base,
                   "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
                   "use_dora": False}, f)


if __name__ == "__main__":
    if sys.argv[1] in ("--vision", "--audio"):
        (build_vision if sys.argv[1] == "--vision" else build_audio)(sys.argv[2])
        sys.exit()
    build(sys.argv[1])
    for n, path in enumerate(sys.argv[2:]):
        adapter(path, sys.argv[1], seed=100 + n)
