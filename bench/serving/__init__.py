"""The serving benchmark (`python -m bench.serving`, run by .venv-vllm): real vLLM OpenAI servers,
kvserver configurations, workloads, routers and the client that times them (docs/benchmarks.md)."""
