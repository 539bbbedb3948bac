"""STAND-IN for the vllm-exl3 plugin (testbed only): vLLM calls register() at start-up."""

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """The real plugin registers the exl3 quantization; the stand-in only says it was called."""
    logger.info("vllm-exl3 stand-in: register() called, nothing to register")
