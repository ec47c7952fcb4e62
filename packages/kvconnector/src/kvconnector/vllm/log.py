"""The connector's logger: a child of vLLM's "vllm" logger, so its lines appear in vLLM's log stream."""

import logging

log = logging.getLogger("vllm.kvconnector")
