#!/usr/bin/env python3
"""Build a tiny, random-weight llama.cpp multimodal projector ("mmproj") GGUF.

For tests only: the weights are random, so the embeddings mean nothing, but the
file loads with libmtmd (llama.cpp as vendored in llama-cpp-python 0.3.36) and
produces embeddings of width --n-embd-text (576 = SmolLM2-135M) for images and,
with --audio, for audio clips too.

    python make_mmproj.py OUT.gguf [--audio] [--no-vision]

Vision: projector type "mlp" (LLaVA-1.5 style: CLIP ViT + 2-layer MLP).
    image_size 32, patch_size 8 -> (32/8)^2 = 16 image tokens per image
    (every image is resized to 32x32, one chunk, no slices, no marker text).
Audio (--audio): projector type "ultravox" (Whisper encoder + stack + SwiGLU MLP).
    Every clip is turned into whisper log-mel chunks of 3000 frames (30 s;
    shorter clips are padded to one chunk); each chunk gives
    1500 / stack_factor tokens = 25 tokens with the default stack factor 60.

Only numpy and the `gguf` package are needed. Output is deterministic
(fixed numpy seed).
"""

import argparse
import sys

import numpy as np

try:
    import gguf
except ImportError:  # pragma: no cover
    sys.exit("the `gguf` package is required: pip install gguf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--audio", action="store_true", help="also add an audio encoder (ultravox)")
    p.add_argument("--no-vision", action="store_true", help="omit the vision encoder (audio-only file; needs --audio)")
    p.add_argument("--n-embd-text", type=int, default=576, help="text model embedding width (SmolLM2-135M: 576)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--stack-factor", type=int, default=60,
                   help="ultravox frame stacking; must divide 1500; tokens per 30 s chunk = 1500/stack_factor")
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args(argv)
    if a.no_vision and not a.audio:
        p.error("--no-vision needs --audio")
    if a.image_size % a.patch_size:
        p.error("image-size must be a multiple of patch-size")
    if 1500 % a.stack_factor:
        p.error("stack-factor must divide 1500 (otherwise clip.cpp's token count check fails)")
    return a


# encoder sizes (shared by the vision and audio towers)
N_EMBD = 64      # encoder width
N_HEAD = 4       # head dim 16
N_FF = 128       # encoder FFN width
N_LAYER = 2      # vision (llava) uses layers [0, n_layer-1), i.e. 1 layer; audio uses both
EPS = 1e-5
MM_HIDDEN = 128  # vision projector hidden width
A_MM_HIDDEN = 32  # audio projector hidden width (its input is n_embd*stack_factor wide)
N_MEL = 80       # whisper mel bins
N_AUDIO_POS = 1500  # whisper: 3000 mel frames -> conv stride 2 -> 1500 positions


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    rng = np.random.default_rng(a.seed)

    def w(*shape, dtype=np.float16, scale=None):
        """Random weight; numpy shape is the reverse of ggml's ne (PyTorch order)."""
        fan_in = shape[-1] if len(shape) >= 2 else 1
        if len(shape) >= 3:  # conv kernels: (out, in, k...) -> fan_in = in * prod(k)
            fan_in = int(np.prod(shape[1:]))
        s = (1.0 / np.sqrt(fan_in)) if scale is None else scale
        return (rng.standard_normal(shape) * s).astype(dtype)

    def ones(n):
        return np.ones((n,), dtype=np.float32)

    def zeros(*shape):
        return np.zeros(shape, dtype=np.float32)

    def small(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(a.out, arch="clip")
    writer.add_string("general.name", "tiny-random-mmproj")
    parts = ([] if a.no_vision else ["mlp vision"]) + (["ultravox audio"] if a.audio else [])
    writer.add_string("general.description", f"random-weight test projector "
                      f"({' + '.join(parts)}) for a {a.n_embd_text}-wide text model")
    writer.add_uint32("general.file_type", 1)  # mostly F16
    writer.add_bool("clip.has_vision_encoder", not a.no_vision)
    writer.add_bool("clip.has_audio_encoder", bool(a.audio))
    # NB: no "clip.projector_type": it would apply to both modalities. Use the
    # per-modality keys clip.vision.projector_type / clip.audio.projector_type.

    def add_tower_hparams(prefix):
        writer.add_uint32(f"clip.{prefix}.embedding_length", N_EMBD)
        writer.add_uint32(f"clip.{prefix}.feed_forward_length", N_FF)
        writer.add_uint32(f"clip.{prefix}.block_count", N_LAYER)
        writer.add_uint32(f"clip.{prefix}.projection_dim", a.n_embd_text)
        writer.add_uint32(f"clip.{prefix}.attention.head_count", N_HEAD)
        writer.add_float32(f"clip.{prefix}.attention.layer_norm_epsilon", EPS)

    def add_layers(p, k_bias):
        for il in range(N_LAYER):
            b = f"{p}.blk.{il}"
            for nm in ("attn_q", "attn_k", "attn_v", "attn_out"):
                writer.add_tensor(f"{b}.{nm}.weight", w(N_EMBD, N_EMBD))
                if nm != "attn_k" or k_bias:
                    writer.add_tensor(f"{b}.{nm}.bias", small(N_EMBD))
            writer.add_tensor(f"{b}.ln1.weight", ones(N_EMBD))
            writer.add_tensor(f"{b}.ln1.bias", zeros(N_EMBD))
            writer.add_tensor(f"{b}.ln2.weight", ones(N_EMBD))
            writer.add_tensor(f"{b}.ln2.bias", zeros(N_EMBD))
            # ffn_up: n_embd -> n_ff ; ffn_down: n_ff -> n_embd  (ggml ne = [in, out])
            writer.add_tensor(f"{b}.ffn_up.weight", w(N_FF, N_EMBD))
            writer.add_tensor(f"{b}.ffn_up.bias", small(N_FF))
            writer.add_tensor(f"{b}.ffn_down.weight", w(N_EMBD, N_FF))
            writer.add_tensor(f"{b}.ffn_down.bias", small(N_EMBD))

    # scale of the final projection: text token embeddings of small LMs have
    # std ~0.02-0.1; keep the fake embeddings in the same range.
    out_scale = 0.05 / np.sqrt(MM_HIDDEN)

    if not a.no_vision:
        n_patches = (a.image_size // a.patch_size) ** 2
        writer.add_string("clip.vision.projector_type", "mlp")
        add_tower_hparams("vision")
        writer.add_uint32("clip.vision.image_size", a.image_size)
        writer.add_uint32("clip.vision.patch_size", a.patch_size)
        writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        writer.add_bool("clip.use_gelu", True)

        # patch embedding conv2d: ggml ne [p, p, 3, n_embd]
        writer.add_tensor("v.patch_embd.weight", w(N_EMBD, 3, a.patch_size, a.patch_size))
        writer.add_tensor("v.patch_embd.bias", small(N_EMBD))
        writer.add_tensor("v.position_embd.weight", small(n_patches, N_EMBD))  # no class token
        writer.add_tensor("v.pre_ln.weight", ones(N_EMBD))
        writer.add_tensor("v.pre_ln.bias", zeros(N_EMBD))
        add_layers("v", k_bias=True)
        # llava MLP projector: mm.0 (n_embd -> hidden), gelu, mm.2 (hidden -> n_embd_text)
        writer.add_tensor("mm.0.weight", w(MM_HIDDEN, N_EMBD))
        writer.add_tensor("mm.0.bias", small(MM_HIDDEN))
        writer.add_tensor("mm.2.weight", w(a.n_embd_text, MM_HIDDEN, scale=out_scale))
        writer.add_tensor("mm.2.bias", zeros(a.n_embd_text))

    if a.audio:
        sf = a.stack_factor
        writer.add_string("clip.audio.projector_type", "ultravox")
        add_tower_hparams("audio")
        writer.add_uint32("clip.audio.num_mel_bins", N_MEL)
        writer.add_uint32("clip.audio.projector.stack_factor", sf)

        # whisper conv front-end: conv1d kernels ggml ne [k, c_in, c_out], biases [1, c_out]
        writer.add_tensor("a.conv1d.1.weight", w(N_EMBD, N_MEL, 3))
        writer.add_tensor("a.conv1d.1.bias", small(N_EMBD, 1))
        writer.add_tensor("a.conv1d.2.weight", w(N_EMBD, N_EMBD, 3))
        writer.add_tensor("a.conv1d.2.bias", small(N_EMBD, 1))
        writer.add_tensor("a.position_embd.weight", small(N_AUDIO_POS, N_EMBD))
        add_layers("a", k_bias=False)  # whisper: no k bias (asserted by clip.cpp)
        writer.add_tensor("a.post_ln.weight", ones(N_EMBD))
        writer.add_tensor("a.post_ln.bias", zeros(N_EMBD))
        # ultravox projector: rms_norm*norm_pre -> mlp.1 -> swiglu -> rms_norm*norm_mid -> mlp.2
        writer.add_tensor("mm.a.norm_pre.weight", ones(N_EMBD * sf))
        writer.add_tensor("mm.a.mlp.1.weight", w(2 * A_MM_HIDDEN, N_EMBD * sf))
        writer.add_tensor("mm.a.norm_mid.weight", ones(A_MM_HIDDEN))
        writer.add_tensor("mm.a.mlp.2.weight", w(a.n_embd_text, A_MM_HIDDEN, scale=0.05 / np.sqrt(A_MM_HIDDEN)))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
