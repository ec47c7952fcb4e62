"""The vLLM engine harness: tiny random checkpoints and engines run in fresh .venv-vllm processes.

The modules that import torch, transformers or vLLM run in .venv-vllm (this package is installed
editable there by scripts/make-vllm-env.sh); `vllm_harness` itself imports none of them."""
