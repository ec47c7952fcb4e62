"""Who a caller is and what it may touch: the server's token and CURVE keys, tenants and their limits.

May import: `config`, kvprotocol.
"""
