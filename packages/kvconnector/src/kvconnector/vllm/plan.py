"""Token arithmetic of the connector: what a hit is worth to vLLM, what to load, what to save.

Pure functions (no vLLM, no torch) so each rule is tested on its own:
- the server answers in whole chunks, or up to a stored tail inside one; vLLM must still compute at
  least one prompt token, so the hit it is told about stops one token short of the request (`usable_hit`);
- a load writes whole blocks from the first block vLLM does not already hold up to the end of
  the last hit chunk, or of the tail's last block (`load_end`): the one extra token, if any, is
  recomputed by vLLM over it;
- a save stores only full chunks, each once (`save_end`).
"""

from __future__ import annotations

import re

from blake3 import blake3

_MODEL_BAD = re.compile(r"[^A-Za-z0-9._/:@+-]")
_MODEL_LEAD = re.compile(r"^[^A-Za-z0-9]+")


def floor_to(n: int, m: int) -> int:
    return n - n % m


def ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def usable_hit(hit_tokens: int, num_tokens: int, local_computed: int) -> int:
    """Tokens vLLM may take from the connector beyond `local_computed` (its own prefix-cache hit).

    At most num_tokens - 1 tokens may be computed before the step: vLLM needs one to sample from.
    """
    return max(0, min(hit_tokens, num_tokens - 1) - local_computed)


def load_end(
    local_computed: int, external_tokens: int, chunk_size: int, hit_tokens: int | None = None, block_size: int = 1
) -> int:
    """End (exclusive) of what a load writes: the chunk holding the last external token, or where the
    hit ends in a tail (`hit_tokens` inside a chunk), the block holding the tail's last token."""
    end = ceil_to(local_computed + external_tokens, chunk_size)
    if hit_tokens is not None and hit_tokens % chunk_size:
        end = min(end, ceil_to(hit_tokens, block_size))
    return end


def save_end(saved_upto: int, computed_after_step: int, limit: int, chunk_size: int) -> int | None:
    """New chunk-aligned end of stored tokens after this step, or None when no new chunk is complete.

    `computed_after_step` tokens have KV once the step ran; `limit` caps what the policy stores (the
    prompt length for save_policy="prompt").
    """
    end = floor_to(min(computed_after_step, limit), chunk_size)
    return end if end > saved_upto else None


def key_salt(cache_salt: str | None) -> str:
    """The salt that goes into object keys for a vLLM `cache_salt`.

    vLLM's salt is free text; ours is a short restricted string, so it is hashed (never sent or
    logged raw). No salt stays "" so unsalted requests share.
    """
    if not cache_salt:
        return ""
    return "v1." + blake3(cache_salt.encode("utf-8")).hexdigest()[:40]


def model_key(name: str) -> str:
    """A model name that kvprotocol accepts (1-200 chars of [A-Za-z0-9._/:@+-], alnum first)."""
    cleaned = _MODEL_LEAD.sub("", _MODEL_BAD.sub("_", name))
    if not cleaned:
        cleaned = "model-" + blake3(name.encode()).hexdigest()[:16]
    if len(cleaned) > 200:
        cleaned = cleaned[:183] + "-" + blake3(name.encode()).hexdigest()[:16]
    return cleaned
