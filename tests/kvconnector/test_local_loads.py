"""local_loads.py: which load in flight brings a prefix, so requests on one prefix share one load.

The engine-level behaviour (four requests, one load, tokens equal to recompute) is in
tests/vllm/test_vllm_connector.py; here, the digest's identity rules and the owner table.
"""

from __future__ import annotations

from kvconnector.vllm.local_loads import LocalLoads, prefix_digests

CHUNK = 4
TOKENS = list(range(100, 116))  # 4 chunks


def test_digest_names_the_whole_prefix_through_each_chunk() -> None:
    full = prefix_digests(TOKENS, "", (), CHUNK, 0, 4)
    assert len(set(full)) == 4
    assert prefix_digests(TOKENS, "", (), CHUNK, 2, 3) == full[2:3]
    # a later chunk differs: the earlier chunks' digests stay, the later ones change
    other = TOKENS[:12] + [0, 0, 0, 0]
    assert prefix_digests(other, "", (), CHUNK, 0, 4)[:3] == full[:3]
    assert prefix_digests(other, "", (), CHUNK, 3, 4) != full[3:]
    # an early token differs: every digest from its chunk on changes
    early = [7] + TOKENS[1:]
    assert not set(prefix_digests(early, "", (), CHUNK, 0, 4)) & set(full)


def test_salt_and_extra_keys_separate_prefixes() -> None:
    plain = prefix_digests(TOKENS, "", (), CHUNK, 0, 4)
    assert prefix_digests(TOKENS, "v1.abc", (), CHUNK, 0, 4)[0] != plain[0]
    lora = prefix_digests(TOKENS, "", ((1, b"adapter"),), CHUNK, 0, 4)
    assert lora[0] == plain[0] and lora[1] != plain[1]  # the extra key of chunk 1 and all after it
    assert prefix_digests(TOKENS, "", ((1, b"other"),), CHUNK, 1, 2) != lora[1:2]


def test_a_prefix_is_loading_while_any_load_of_it_runs() -> None:
    loads = LocalLoads()
    a = prefix_digests(TOKENS, "", (), CHUNK, 0, 3)
    loads.add("r1", a)
    loads.add("r2", prefix_digests(TOKENS, "", (), CHUNK, 2, 4))  # overlaps r1 at chunk 2
    assert [loads.owner(d) for d in prefix_digests(TOKENS, "", (), CHUNK, 0, 4)] == ["r1", "r1", "r1", "r2"]
    loads.done("r1")
    assert [loads.owner(d) for d in a] == [None, None, "r2"]  # r2 still brings chunk 2
    assert len(loads) == 1
    loads.done("r2")
    loads.done("r2")  # twice (finished receiving, then finished): harmless
    assert len(loads) == 0 and not loads
