"""pad inside serving engines: the vLLM plugin (``pad.serving.vllm``)."""
