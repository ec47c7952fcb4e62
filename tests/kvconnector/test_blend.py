"""kvconnector.blend on a small Llama from transformers, with chunks stored in and loaded from a real kvserver."""

from __future__ import annotations

import mmap
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvconnector.blend import BlendStore, ChunkCodec, ReusedChunk, blend_prefill, full_prefill, rerope  # noqa: E402
from kvserver.l1.arena import HEADER_BYTES  # noqa: E402
from kvtestkit.serverproc import free_port  # noqa: E402

C = 64


def tiny_llama(layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return transformers.LlamaForCausalLM(cfg).float().eval()


def doc_kv(model, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K/V (kv_heads, T, head_dim) of a document computed alone, at positions 0.."""
    with torch.no_grad():
        cache = model(tokens[None], use_cache=True).past_key_values
    return [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]


def test_rerope_equals_rope_at_the_new_positions():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, rope_theta=10000.0)
    rot = LlamaRotaryEmbedding(cfg)
    raw = torch.randn(1, 2, C, 32)  # (batch, kv_heads, tokens, head_dim) before RoPE
    for p0, p1 in [(0, 0), (0, 517), (300, 7), (0, 4000)]:
        at = [rot(raw, torch.arange(p, p + C)[None]) for p in (p0, p1)]
        k0 = apply_rotary_pos_emb(raw, raw, *at[0])[1]
        k1 = apply_rotary_pos_emb(raw, raw, *at[1])[1]
        moved = rerope(k0[0], p1 - p0, rot.inv_freq)
        assert torch.allclose(moved, k1[0], atol=1e-3), (p0, p1)  # HF's own fp32 angles at p=4000: ~5e-4
        if p0 != p1:
            assert not torch.allclose(k0, k1, atol=1e-2)  # the rotation is not a no-op


def test_layer0_kv_of_a_moved_chunk_is_exact_after_rerope():
    model = tiny_llama()
    prompt = torch.randint(0, 300, (400,))
    k_doc, v_doc = doc_kv(model, prompt[200 : 200 + C])
    k_all, v_all = doc_kv(model, prompt)
    moved = rerope(k_doc[0], 200, model.model.rotary_emb.inv_freq)
    assert torch.allclose(moved, k_all[0][:, 200 : 200 + C], atol=1e-4)
    assert torch.allclose(v_doc[0], v_all[0][:, 200 : 200 + C], atol=1e-5)  # V carries no position
    assert not torch.allclose(k_doc[1], k_all[1][:, 200 : 200 + C], atol=1e-3)  # deeper layers deviate


def test_codec_round_trip():
    codec = ChunkCodec(num_layers=3, num_kv_heads=2, head_dim=8, chunk_size=C)
    k = [torch.randn(2, C, 8) for _ in range(3)]
    v = [torch.randn(2, C, 8) for _ in range(3)]
    data = codec.encode(k, v)
    assert len(data) == codec.layout.object_bytes
    k2, v2 = codec.decode(data)
    assert all(torch.equal(a, b) for a, b in zip(k + v, k2 + v2))
    with pytest.raises(ValueError):
        codec.decode(data[:-4])


def _kl(full: torch.Tensor, other: torch.Tensor) -> float:
    p = torch.log_softmax(full.float(), -1)
    return float((p.exp() * (p - torch.log_softmax(other.float(), -1))).sum())


def test_blend_through_a_real_server_improves_with_recompute(server_factory):
    server = server_factory("--l1-size-gb", "0.05", "--chunk-size", str(C))
    model = tiny_llama()
    cfg = model.config
    codec = ChunkCodec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, C)
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 300, (int(n),), generator=gen) for n in (150, 200, 130, 190)]
    with BlendStore(server.url, "tiny-llama", codec) as store:
        for d in docs:
            k, v = doc_kv(model, d)
            assert store.store_document(d, k, v) == len(d) // C
        parts = [torch.tensor([1, 2, 2, 1]), docs[2], docs[0], docs[3], torch.randint(3, 300, (20,), generator=gen)]
        starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
        prompt = torch.cat(parts)
        loaded = store.load(prompt.tolist(), starts)
        assert [ch.start for ch in loaded] == [
            s + i * C for s, d in zip(starts[1:4], (docs[2], docs[0], docs[3])) for i in range(len(d) // C)
        ]
        assert not store.stats.errors
        # an unknown document in the same place finds nothing
        assert store.lookup(torch.cat([parts[0], docs[1] + 1]).tolist(), [0, 4]) == []
    chunks = [ReusedChunk(ch.start, ch.ref_pos, ch.k, ch.v) for ch in loaded]
    ref = full_prefill(model, prompt)
    kl = {r: _kl(ref.logits, blend_prefill(model, prompt, chunks, r).logits) for r in (0.0, 0.15, 0.5, 1.0)}
    reuse = blend_prefill(model, prompt, chunks, 0.0, reuse_only=True)
    kl_reuse = _kl(ref.logits, reuse.logits)
    assert kl[1.0] < 1e-8  # recompute everything = the full prefill
    assert kl_reuse > 0 and kl[0.0] > 0
    assert kl[0.5] < kl[0.0] and kl[0.5] < kl_reuse
    assert kl[0.15] < kl_reuse
    assert reuse.saved > blend_prefill(model, prompt, chunks, 0.15).saved > 0
    # decoding continues from the blended cache
    blended = blend_prefill(model, prompt, chunks, 0.15)
    nxt = blended.logits.argmax()[None, None]
    with torch.no_grad():
        out = model(nxt, cache=blended.cache, use_cache=True)
    assert out.logits.shape[-1] == cfg.vocab_size


def test_server_down_is_a_miss():
    codec = ChunkCodec(2, 2, 8, C)
    with BlendStore(f"tcp://127.0.0.1:{free_port()}", "m", codec, timeout=0.3, token="x") as store:
        assert store.load(list(range(200)), [0]) == []
        assert store.store_document(list(range(C)), [torch.zeros(2, C, 8)] * 2, [torch.zeros(2, C, 8)] * 2) == 0
        assert store.stats.errors


def test_a_damaged_chunk_is_a_miss_and_its_report_drops_it_on_the_server(server_factory):
    """A stray write into the arena: the load verifies each chunk's kvsum64, misses as a whole, and
    its release reports the chunk; the server confirms and drops it, so the next load gets the rest."""
    server = server_factory("--l1-size-gb", "0.01", "--chunk-size", str(C))
    codec = ChunkCodec(2, 2, 8, C)
    gen = torch.Generator().manual_seed(3)
    doc = torch.randint(3, 300, (2 * C,), generator=gen)
    k = [torch.randn(2, 2 * C, 8, generator=gen) for _ in range(2)]
    v = [torch.randn(2, 2 * C, 8, generator=gen) for _ in range(2)]
    with BlendStore(server.url, "m", codec) as store, server.client() as c:
        assert store.store_document(doc, k, v) == 2
        assert [ch.start for ch in store.load(doc.tolist(), [0])] == [0, C]
        l1 = c.call("describe").result["l1"]
        fd = os.open(f"/dev/shm/{l1['arena']}", os.O_RDWR)
        try:
            arena = mmap.mmap(fd, l1["capacity_bytes"])
        finally:
            os.close(fd)
        arena[HEADER_BYTES + 100] ^= 0x01  # the first slot: chunk 0, the first object stored
        arena.close()
        assert store.load(doc.tolist(), [0]) == []
        assert store.stats.errors == {"load:CorruptCopy": 1}
        counters = c.call("describe").result["counters"]
        assert (counters["corrupt_dropped"], counters["corrupt_refuted"]) == (1, 0)
        loaded = store.load(doc.tolist(), [0])
        assert [ch.start for ch in loaded] == [C]  # chunk 0 is gone; chunk 1 was intact
        assert torch.equal(loaded[0].k[0], k[0][:, C:])
