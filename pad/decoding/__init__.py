"""Decoding: the speculative decode loop, its policies, statistics and the HuggingFace glue it needs."""
