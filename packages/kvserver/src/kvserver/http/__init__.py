"""The HTTP side of kvserver: admin API, Prometheus metrics and coordinator registration.

Imported only when the HTTP port or a coordinator is configured, so a bare `kvserver start --http-port 0`
never pays for FastAPI.
"""
