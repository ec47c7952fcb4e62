"""Builds a tiny random-weight Idefics3 (SigLIP-style vision tower + Llama) locally: no downloads,
no torchvision (the PIL image processor), a `tokenizers` WordLevel tokenizer.

Prompts are text of words `w0`..`w899` with one `<image>`; the processor expands it to
`<fake_token_around_image><global-img>` + IMAGE_SEQ_LEN x `<image>` + `<fake_token_around_image>`,
whose ids are the same whatever the image.
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = 900
IMAGE_SIZE = 128
PATCH = 16
SCALE = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2


def _vocab() -> dict[str, int]:
    special = ["[UNK]", "<s>", "</s>", "<image>", "<fake_token_around_image>", "<end_of_utterance>", "<global-img>"]
    special += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    return {tok: i for i, tok in enumerate(special + [f"w{k}" for k in range(WORDS)])}


def build_idefics3(out_dir: Path, seed: int = 1234) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

    out_dir = Path(out_dir)
    stamp = out_dir / "kv_test_vlm.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"seed": seed}:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = _vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [t for t in vocab if t.startswith("<") or t.startswith("[")]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=[t for t in specials if t not in ("[UNK]", "<s>", "</s>")],
    )
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True,
        size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_pad=True,
    )
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN)
    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": 1024,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH,
        },
        scale_factor=SCALE,
        image_token_id=vocab["<image>"],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # a strong projection, so that the image visibly changes the text model's KV
        for name, p in model.named_parameters():
            if "modality_projection" in name:
                p.normal_(0, 4.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    stamp.write_text(json.dumps({"seed": seed}))
    return out_dir


def words(n: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n))


def image(seed: int):  # -> PIL.Image.Image
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))
