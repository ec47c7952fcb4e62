"""A stalled shm writer (found by the chaos soak, #40): stopped past its reservation's TTL and its
slots' quarantine, it copies into a slot that now holds another object (another tenant's, even).
Readers refuse those bytes by checksum, but the object stayed in L1 and failed every later hit. The
server now checks the slots of such a writer when it speaks again (its late commit) and drops the
object it overwrote; an object it left intact stays. Real server, real sockets, the real arena."""

from __future__ import annotations


from kvtestkit.kvhelpers import ArenaMap, lookup, payload, register, store, tiny_layout, wait_quarantine_over
from kvprotocol import ServerError

OBJ = tiny_layout().object_bytes
TTL = "0.5"


def tokens(base: int) -> list[int]:
    return list(range(base, base + 256))


def reused_slot(srv, overwrite: bool) -> tuple[int, int]:
    """A late writer's reservation expires and is quarantined; once its slot is free again a victim
    is stored there; then the writer (maybe) copies into it and commits late. Returns the victim's
    hit tokens afterwards and the server's count of dropped objects."""
    with srv.client() as c:
        ks, reg = register(c)
        arena = ArenaMap(reg["arena"]["name"], reg["arena"]["size"])
        late = store(c, ks, tokens(0), None, mode="shm", commit=False)
        (slot,) = late["slots"]
        wait_quarantine_over(c)
        victim = store(c, ks, tokens(10_000), lambda ch, g: payload(1, OBJ), mode="shm", arena=arena)
        assert victim["slots"][0]["offset"] == slot["offset"]  # the precondition: the slot was reused
        if overwrite:
            arena.write(slot["offset"], payload(2, OBJ))  # the stalled writer's copy lands now
        try:
            c.call("commit", store_id=late["store_id"], checksums=[0])
            raise AssertionError("a late commit must be refused")
        except ServerError as exc:
            assert exc.code == "UNKNOWN_STORE"
        hit = lookup(c, ks, tokens(10_000))
        dropped = c.call("describe").result["counters"].get("late_write_dropped", 0)
        arena.close()
        return hit, dropped


def test_an_object_a_late_writer_overwrote_is_dropped_at_its_late_commit(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", "--lease-ttl", TTL)
    hit, dropped = reused_slot(srv, overwrite=True)
    assert hit == 0  # before the fix: 256, a hit whose every load failed verification
    assert dropped == 1


def test_an_object_the_late_writer_left_intact_stays(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", "--lease-ttl", TTL)
    hit, dropped = reused_slot(srv, overwrite=False)
    assert hit == 256 and dropped == 0
