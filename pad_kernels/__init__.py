"""Fused verification op for speculative decoding: one call per block (see ``verify_block``)."""
from .types import FEATURE_NAMES, FoldedClassifier, VerifyResult
from .verify import BACKEND_NAMES, available_backends, resolve_backend, verify_block
from .verify_ref import verify_block_ref

__all__ = [
    "BACKEND_NAMES",
    "FEATURE_NAMES",
    "FoldedClassifier",
    "VerifyResult",
    "available_backends",
    "resolve_backend",
    "verify_block",
    "verify_block_ref",
]
