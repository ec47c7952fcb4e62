"""Tenant isolation: a bystander's pings while another tenant attacks one feature
(`python -m bench.isolation.ec_pings`, ...; bystander.py is the shared harness)."""
