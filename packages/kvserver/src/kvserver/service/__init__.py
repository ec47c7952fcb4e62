"""The cache service over L1: what each KV op does, without sockets.

Lookups, stores (one admission path for every kind of store), commits, retrieves, read sessions and
their leases, whole-request reservations, per-group geometry, the engine and layout tables, and the
counters. Ops take a typed request and the caller's `Identity` and return the reply map.
Composed, not inherited: `CacheState` (state.py) holds the collaborators; the key planner (keys.py),
session admission, store admission and the read, write and registration operations take it; `CacheService`
(cache.py) is the facade the handlers call.
May import: `l1`, `security` (identities, limits), `l2` (prefetch on a miss), `errors`.
"""
