"""The L1 store: the shared-memory arena, its allocator, the object index and eviction.

Owns bytes and object states (writing, ready, leased, pinned, quarantined), the prefix links that
make eviction prefix-aware, and one file per eviction policy. It knows objects, not requests,
sessions or credentials. May import: kvprotocol, and nothing else of kvserver but `errors`.
"""
