"""Fused verification op for speculative decoding: one call per block (see ``verify_block``)."""
from .graph import VerifyGraph
from .types import FEATURE_NAMES, RULES, AcceptRule, FoldedClassifier, VerifyResult, Workspace
from .verify import BACKEND_NAMES, available_backends, resolve_backend, verify_block
from .verify_ref import verify_block_ref
from .verify_varlen import verify_block_varlen, verify_block_varlen_ref

__all__ = [
    "AcceptRule",
    "BACKEND_NAMES",
    "FEATURE_NAMES",
    "FoldedClassifier",
    "RULES",
    "VerifyGraph",
    "VerifyResult",
    "Workspace",
    "available_backends",
    "resolve_backend",
    "verify_block",
    "verify_block_ref",
    "verify_block_varlen",
    "verify_block_varlen_ref",
]
