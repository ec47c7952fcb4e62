"""Run by .venv-vllm: extra keys of real vLLM `Request` objects, next to vLLM's own block extra keys.

python mm_keys_probe.py ADAPTER_DIR   -> prints one JSON object (see test_vllm_mm_keys.py)
"""

from __future__ import annotations

import json
import sys

import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
from vllm.v1.request import Request

from kvconnector.vllm.extra_keys import AdapterDigests, digest_parts, request_keys
from kvprotocol import chunk_hashes

C = 256
TOKENS = [7] * 900  # placeholder ids: the same whatever the image


def image(ident: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=ident,
        mm_position=PlaceholderRange(offset=offset, length=length),
        mm_hash=ident,
    )


def request(rid: str, mm=None, lora=None, embeds=None) -> Request:
    return Request(
        rid,
        None if embeds is not None else TOKENS,
        SamplingParams(max_tokens=1),
        None,
        mm_features=mm,
        lora_request=lora,
        prompt_embeds=embeds,
    )


def main(adapter_dir: str) -> None:
    adapters = AdapterDigests()
    cases = {
        "plain": request("p"),
        "img_a": request("a", [image("img-a", 300, 64)]),
        "img_b": request("b", [image("img-b", 300, 64)]),
        "img_a_moved": request("m", [image("img-a", 320, 64)]),
        "two_images": request("t", [image("img-a", 100, 64), image("img-b", 500, 100)]),
        "lora": request("l", lora=LoRARequest("adapter", 1, adapter_dir)),
        "lora_img": request("li", [image("img-a", 300, 64)], lora=LoRARequest("adapter", 1, adapter_dir)),
    }
    out: dict = {}
    for name, req in cases.items():
        keys = request_keys(req, len(TOKENS), C, adapters)
        # vLLM's own extra keys for each chunk's token range, mapped through our digest: they must
        # give exactly our per-chunk digests (the same facts, chunk by chunk).
        ours_from_vllm = []
        adapter_digest = adapters.get(adapter_dir)
        for i in range(len(TOKENS) // C):
            vk, _ = generate_block_hash_extra_keys(req, i * C, (i + 1) * C, 0)
            parts = []
            for k in vk or ():
                if k[0] == "lora":
                    parts.append(("lora", k[1], adapter_digest))
                elif k[0] == "mm":
                    parts.append(k)
            if parts:
                ours_from_vllm.append([i, digest_parts(parts).hex()])
        out[name] = {
            "cacheable": keys.cacheable,
            "extra": [[i, d.hex()] for i, d in keys.extra],
            "from_vllm": ours_from_vllm,
            "hashes": [h.hex() for h in chunk_hashes(TOKENS, C, keys.extra)],
        }
    embeds = request("e", embeds=torch.zeros(len(TOKENS), 16))
    out["prompt_embeds"] = {"cacheable": request_keys(embeds, len(TOKENS), C, adapters).cacheable}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
