"""The fleet coordinator: soft-state membership of kvservers, fleet status by fan-out, and fleet
lookup (which instance holds the longest prefix). It holds no KV bytes and persists nothing: after a
restart, the servers' heartbeats get 404 and they register again.

Torch-free and kvserver-free: it speaks to servers only over their HTTP admin API. Modules are
imported directly (`kvcoordinator.app`), so `binding` stays cheap to import.
"""
