"""CacheBlend on the server: the content index, `blend_store` and `blend_lookup`.

Blend objects are ordinary L1 objects admitted like any store; only their chunk-hash field differs.
May import: `service`, `security`, `errors`.
"""
