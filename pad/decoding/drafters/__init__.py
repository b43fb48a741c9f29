"""Drafters: what proposes a block's draft tokens (``Drafter``), and ``make_drafter`` for the names
``pad.generate`` and the command line take: ``model``, ``lookup``, ``suffix``, ``hybrid``."""
from __future__ import annotations

import weakref

from .base import SOURCES, Drafter, FreeDrafter, Proposal, Sampling, pack
from .hybrid import HybridDrafter
from .lookup import LookupDrafter, NgramIndex
from .model import ModelDrafter
from .suffix import SuffixDrafter

NAMES = ("model", "lookup", "suffix", "hybrid")
NEEDS_MODEL = ("model", "hybrid")
# drafter="suffix" keeps its global counts (earlier outputs) per target model for the process.
_SUFFIX: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def make_drafter(drafter, draft=None, *, target=None, draft_stop: float | None = None) -> Drafter:
    """A drafter name (or a ``Drafter``, returned as it is) -> a ``Drafter``. ``draft``: the draft model, needed by
    ``model`` and ``hybrid``; ``target``: the model whose process-wide suffix counts ``suffix`` uses."""
    if not isinstance(drafter, str):
        if not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be one of {', '.join(NAMES)} or a Drafter, got {type(drafter).__name__}")
        return drafter
    if drafter not in NAMES:
        raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(NAMES)}")
    if drafter in NEEDS_MODEL and draft is None:
        raise ValueError(f"drafter {drafter!r} needs a draft model")
    if draft_stop is not None and drafter not in NEEDS_MODEL:
        raise ValueError(f"draft_stop stops a draft model's drafting; drafter {drafter!r} runs none")
    if drafter == "model":
        return ModelDrafter(draft, draft_stop)
    if drafter == "hybrid":
        return HybridDrafter(ModelDrafter(draft, draft_stop))
    if drafter == "lookup":
        return LookupDrafter()
    if target is None:
        return SuffixDrafter()
    return _SUFFIX.setdefault(target, SuffixDrafter())


__all__ = ["NAMES", "SOURCES", "Drafter", "FreeDrafter", "HybridDrafter", "LookupDrafter", "ModelDrafter",
           "NgramIndex", "Proposal", "Sampling", "SuffixDrafter", "make_drafter", "pack"]
