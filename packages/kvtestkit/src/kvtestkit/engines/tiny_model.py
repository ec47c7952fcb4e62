"""Builds small random-weight Llama checkpoints locally with transformers (no downloads).

Weights are drawn from a fixed seed, so two builds with the same arguments are byte-identical and
two engine processes that load the same directory compute the same KV.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlamaSpec:
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 1024
    intermediate_size: int = 256
    max_position_embeddings: int = 8192
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


TINY = TinyLlamaSpec()
# The timing model of DESIGN.md: 8 layers x hidden 1024, 32 KiB of fp32 KV per token.
BENCH = TinyLlamaSpec(
    num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=8, vocab_size=1024, intermediate_size=2816
)


def build_llama(out_dir: Path, spec: TinyLlamaSpec = TINY) -> Path:
    """Writes a random fp32 Llama (config + safetensors) into out_dir and returns it.

    Skips the build when out_dir already holds a checkpoint made from the same spec.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    stamp = out_dir / "kv_test_spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        torch_dtype="float32",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(spec)))
    return out_dir


def random_prompt(length: int, seed: int, vocab_size: int = 1024) -> list[int]:
    """Token ids in [3, vocab_size): avoids the bos/eos ids so generation never stops early."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def build_lora(
    out_dir: Path, base_dir: Path, seed: int, rank: int = 8, spec: TinyLlamaSpec = TINY, scale: float = 0.2
) -> Path:
    """Writes a random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for the
    tiny Llama: q/k/v/o projections of every layer. Unlike PEFT's own initialisation (B = 0, a no-op),
    both matrices are random, so the adapter changes every token's K/V."""
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    kv_dim = spec.num_kv_heads * spec.head_dim
    shapes = {
        "q_proj": (spec.hidden_size, spec.hidden_size),
        "k_proj": (spec.hidden_size, kv_dim),
        "v_proj": (spec.hidden_size, kv_dim),
        "o_proj": (spec.hidden_size, spec.hidden_size),
    }
    tensors = {}
    for layer in range(spec.num_layers):
        for mod, (d_in, d_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * scale
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": rank * 2,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(shapes),
                "base_model_name_or_path": str(base_dir),
                "fan_in_fan_out": False,
                "modules_to_save": None,
            }
        )
    )
    return out_dir
