"""Tiny random-weight checkpoints of other attention kinds (no downloads): MLA and sliding windows.

Like tiny_model.py, weights come from a fixed seed, so every build of one spec is byte-identical.
- `build_deepseek_v2`: DeepSeek-V2-style multi-head latent attention. vLLM's CPU MLA backend only
  compiles the latent size kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 and block size 16.
- `build_mistral_sw`: a Mistral (Llama-style) model whose every layer has a sliding window.
- `build_gemma3`: a Gemma-3 text model, a sliding-window layer then a global one.
- `build_qwen3_next`: a Qwen3-Next hybrid, gated delta net layers between full-attention ones.
- `build_granite4`: a Granite-4-style hybrid, Mamba2 layers between full-attention ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


_COMMON: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    max_position_embeddings=4096,
    torch_dtype="float32",
    bos_token_id=1,
    eos_token_id=2,
)


def _save(out_dir: Path, config_cls: str, model_cls: str, seed: int, **config: Any) -> Path:
    """Build `model_cls(config_cls(**_COMMON, **config))` from `seed` and save it as safetensors (once)."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    cfg = getattr(transformers, config_cls)(**{**_COMMON, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_deepseek_v2(out_dir: Path, seed: int = 1234) -> Path:
    return _save(
        out_dir,
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        seed,
        num_attention_heads=2,
        num_key_value_heads=2,
        moe_intermediate_size=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        tie_word_embeddings=False,
        rope_scaling=None,
    )


def build_mistral_sw(out_dir: Path, window: int = 96, seed: int = 1234) -> Path:
    return _save(
        out_dir,
        "MistralConfig",
        "MistralForCausalLM",
        seed,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=window,
        tie_word_embeddings=False,
    )


def build_gemma3(out_dir: Path, window: int = 96, seed: int = 1) -> Path:
    return _save(
        out_dir,
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        seed,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
    )


def build_qwen3_next(out_dir: Path, seed: int = 1234) -> Path:
    """Qwen3-Next-style hybrid: gated delta net (linear attention, a recurrent state) and full
    attention, alternating; a tiny MoE MLP as in the real model. vLLM CPU runs its GDN in bf16 only."""
    return _save(
        out_dir,
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        seed,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,  # vLLM's CPU gated-delta-rule kernel takes head dim 128 (not 32)
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    )


def build_granite4(out_dir: Path, seed: int = 1234) -> Path:
    """Granite-4-style hybrid (GraniteMoeHybrid): Mamba2 layers and full attention, alternating; a
    dense MLP (no experts)."""
    return _save(
        out_dir,
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        seed,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        num_local_experts=0,
        shared_intermediate_size=256,
        position_embedding_type="rope",
        tie_word_embeddings=False,
    )
