"""Prefill/decode disaggregation through kvserver (`python -m bench.pd.proxy`, docs/pd.md)."""
