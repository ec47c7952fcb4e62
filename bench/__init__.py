"""Benchmarks: each module prints its figures next to a baseline measured in the same run.

Run them from the repository root as modules (`uv run python -m bench.server`; the vLLM ones with
`.venv-vllm/bin/python -m bench.serving`); the shared process and kv helpers are in kvtestkit.
`bench/gpu_check.py` alone also runs as a plain script, on a GPU machine without the workspace."""
