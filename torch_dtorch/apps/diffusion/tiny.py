"""Tiny random diffusers pipelines built offline (no hub access): FLUX and SD3 with in-memory tokenizers.

They exist so that ``dtorch diffuse`` runs on any laptop and tests compare against single-device diffusers; the
weights are random (seeded), so the images are noise-like but deterministic. The tokenizers are built the way
transformers 5 allows without files: ``CLIPTokenizer(vocab=dict, merges=list)`` and
``T5Tokenizer(vocab=[(piece, score)], extra_ids=0)``.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TinySizes", "tiny_flux_pipeline", "tiny_pipeline", "tiny_sd3_pipeline"]


@dataclass(frozen=True, kw_only=True)
class TinySizes:
    """Sizes of the tiny pipelines (kept small: a test image of 32x32 pixels runs in well under a second)."""

    num_attention_heads: int = 4
    attention_head_dim: int = 8
    num_layers: int = 1
    num_single_layers: int = 1
    text_hidden: int = 16
    text_len: int = 8
    vae_channels: int = 8


def _clip_tokenizer() -> Any:
    from transformers import CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + " .,!?'-")
    vocab: dict[str, int] = {}
    for c in chars:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77, pad_token="<|endoftext|>")


def _t5_tokenizer() -> Any:
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0 - i * 0.01) for i, c in enumerate(string.ascii_lowercase + string.digits + ".,!?'-")]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _clip_encoder(sizes: TinySizes, vocab_size: int, *, projection: bool) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=sizes.text_hidden, intermediate_size=2 * sizes.text_hidden,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77, projection_dim=sizes.text_hidden,
        bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
    )  # fmt: skip
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(cfg).eval()


def _t5_encoder(sizes: TinySizes, vocab_size: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=vocab_size, d_model=sizes.text_hidden, d_kv=8, d_ff=2 * sizes.text_hidden, num_layers=1,
        num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
    )  # fmt: skip
    return T5EncoderModel(cfg).eval()


def _vae(sizes: TinySizes, *, latent_channels: int, flux: bool) -> Any:
    from diffusers import AutoencoderKL

    vae: Any = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(sizes.vae_channels,) * 2,
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=sizes.vae_channels, sample_size=32,
        use_quant_conv=not flux, use_post_quant_conv=not flux, shift_factor=0.0609 if flux else 0.0,
        scaling_factor=1.5035 if flux else 1.5305,
    )  # fmt: skip
    return vae.eval()


def tiny_flux_pipeline(*, seed: int = 0, sizes: TinySizes | None = None) -> Any:
    """A ``FluxPipeline`` with a 1+1-block transformer, a 2-level VAE (2x downscale),
    CLIP and T5 text encoders; every weight random from ``seed``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    s = sizes or TinySizes()
    torch.manual_seed(seed)
    tok, tok2 = _clip_tokenizer(), _t5_tokenizer()
    quarter = (
        s.attention_head_dim // 4
    )  # rotary dims per (frame, row, column) id axis; they sum to the head dim
    rope = (s.attention_head_dim - 2 * quarter, quarter, quarter)
    transformer: Any = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=s.num_layers, num_single_layers=s.num_single_layers,
        attention_head_dim=s.attention_head_dim, num_attention_heads=s.num_attention_heads,
        joint_attention_dim=s.text_hidden, pooled_projection_dim=s.text_hidden, guidance_embeds=True,
        axes_dims_rope=rope,
    )  # fmt: skip
    transformer.eval()
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(s, latent_channels=4, flux=True),
        text_encoder=_clip_encoder(s, len(tok), projection=False),
        tokenizer=tok,
        text_encoder_2=_t5_encoder(s, len(tok2)),
        tokenizer_2=tok2,
        transformer=transformer,
    )


def tiny_sd3_pipeline(*, seed: int = 0, sizes: TinySizes | None = None) -> Any:
    """A ``StableDiffusion3Pipeline`` with a 1-block transformer, a 2-level VAE, two CLIPs and a T5."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    s = sizes or TinySizes()
    torch.manual_seed(seed)
    tok, tok3 = _clip_tokenizer(), _t5_tokenizer()
    transformer: Any = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=s.num_layers, attention_head_dim=s.attention_head_dim,
        num_attention_heads=s.num_attention_heads, joint_attention_dim=s.text_hidden,
        caption_projection_dim=s.num_attention_heads * s.attention_head_dim, pooled_projection_dim=2 * s.text_hidden,
        out_channels=4, pos_embed_max_size=32,
    )  # fmt: skip
    transformer.eval()
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(s, latent_channels=4, flux=False),
        text_encoder=_clip_encoder(s, len(tok), projection=True),
        tokenizer=tok,
        text_encoder_2=_clip_encoder(s, len(tok), projection=True),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_encoder(s, len(tok3)),
        tokenizer_3=tok3,
        transformer=transformer,
    )


def tiny_pipeline(model: str, *, seed: int = 0, sizes: TinySizes | None = None) -> Any:
    """``"flux"`` or ``"sd3"``: the tiny random pipeline of that family."""
    builders = {"flux": tiny_flux_pipeline, "sd3": tiny_sd3_pipeline}
    if model not in builders:
        raise ValueError(f"tiny_pipeline: model must be one of {sorted(builders)}, got {model!r}")
    return builders[model](seed=seed, sizes=sizes)
