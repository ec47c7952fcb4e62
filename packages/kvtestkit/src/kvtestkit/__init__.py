"""Support code shared by tests/ and bench/: real kvserver and coordinator processes on free ports,
kv and HTTP helpers, the offline trace simulation and the vLLM engine harness.

Private to this repository (never published). This module imports nothing, so a script that only
needs `kvtestkit.ports` (bench/gpu_check.py on a bare GPU machine) gets nothing else."""
