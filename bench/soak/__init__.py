"""Chaos soak (#40): engine clients under a shared-prefix load while a seeded schedule of faults hits
the server, Redis, the fs tier and the clients; every loaded byte is checked and every object durable
in L2 before a fault must still be there after it. Run: `python -m bench.soak --quick`."""
