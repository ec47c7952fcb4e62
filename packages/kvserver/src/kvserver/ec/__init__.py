"""The encoder cache: one encoder output per multimodal item, in its own shm segment.

Its allocator, index, leases and stores, and each tenant's bounds on them.
May import: `l1` (the arena), `security`, `errors`.
"""
