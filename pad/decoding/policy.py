"""Decoding policies and their one grammar, shared by ``pad.generate`` and ``pad-decoding bench``.

``NAME[@A[,B]]``: ``target``, ``draft`` (one model alone), ``exact`` (standard speculative decoding),
``pivot@SIGMA`` (the pivot classifier), and the training-free relaxations of the exact rule, decided
inside ``pad_kernels.verify_block`` (see ``pad_kernels.AcceptRule``): ``typical@EPSILON,DELTA``
(defaults 0.09, 0.3), ``threshold@TAU``, ``fly@GATE,WINDOW`` (defaults 0.3, 6; greedy only), and the two
that also read the draft's distribution: ``kl@EPSILON[,TOP1]`` (KL(p || q) <= epsilon where the target's
top-1 probability is below top1, default 1) and ``topk@K,DELTA`` (the draft token among the target's K
most likely, its probability within delta of the top-1's).
"""
from __future__ import annotations

from dataclasses import dataclass

from pad_kernels import AcceptRule

ALONE = ("target", "draft")
SPECULATIVE = ("exact", "pivot", "typical", "threshold", "fly", "kl", "topk")
NAMES = ALONE + SPECULATIVE
# Settings after "@": their names and defaults (None: required).
# pivot's sigma when none is given, chosen for the shipped classifier (5bb6d08638e95490) by decoding GSM8K
# train 7000-7095, never labeled nor reported: the largest of 0.1, 0.15, 0.2 and 0.3 within 2 points of exact's
# accuracy there (bench/results/gsm8k_train_7000-7095_frontier_bfloat16.md; docs/results.md says why exact's).
DEFAULT_SIGMA = 0.3
SETTINGS = {"pivot": (("sigma", None),), "typical": (("epsilon", 0.09), ("delta", 0.3)),
            "threshold": (("tau", None),), "fly": (("gate", 0.3), ("window", 6)),
            "kl": (("epsilon", None), ("top1", 1.0)), "topk": (("k", None), ("delta", None))}


@dataclass(frozen=True)
class Policy:
    """A parsed policy: ``name`` and its settings (``sigma`` for pivot, else an ``AcceptRule``)."""

    name: str
    sigma: float | None = None  # pivot: None means generate's ``sigma`` argument
    rule: AcceptRule = AcceptRule()

    def __str__(self) -> str:
        if self.name == "pivot" and self.sigma is not None:
            return f"pivot@{self.sigma:g}"
        if self.rule.name == "threshold":
            return f"threshold@{self.rule.a:g}"
        if self.rule.name in ("typical", "fly", "kl", "topk"):
            return f"{self.name}@{self.rule.a:g},{self.rule.b:g}"
        return self.name


def parse_policy(spec) -> Policy:
    """``"typical@0.09,0.3"`` (or a ``Policy``) -> Policy; raises ValueError naming what is wrong."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"policy must be a string like 'typical@0.09,0.3' or a pad.Policy, got {type(spec).__name__}")
    name, _, rest = spec.strip().partition("@")
    if name not in NAMES:
        raise ValueError(f"unknown policy {spec!r}; choose one of {', '.join(NAMES)} (settings after @, for example "
                         "pivot@0.3, typical@0.09,0.3, threshold@0.2, fly@0.3,6, kl@0.5,0.9, topk@3,0.1)")
    names = SETTINGS.get(name, ())
    try:
        given = [float(v) for v in rest.split(",")] if rest else []
    except ValueError:
        raise ValueError(f"bad number in policy {spec!r}") from None
    if len(given) > len(names):
        raise ValueError(f"policy {name} takes {len(names)} setting(s) ({', '.join(n for n, _ in names) or 'none'}), "
                         f"got {spec!r}")
    values = given + [default for _, default in names[len(given):]]
    missing = [n for (n, _), v in zip(names, values) if v is None and not (name == "pivot")]
    if missing:
        raise ValueError(f"policy {name} needs {', '.join(missing)}: write {name}@{','.join(n.upper() for n, _ in names)}")
    if name == "pivot":
        sigma = values[0]
        if sigma is not None and not 0.0 <= sigma <= 1.0:
            raise ValueError(f"sigma in policy {spec!r} must be in [0, 1]")
        return Policy("pivot", sigma=sigma)
    if name == "typical":
        rule = AcceptRule.typical(*values)
    elif name == "threshold":
        rule = AcceptRule.threshold(*values)
    elif name == "fly":
        if values[1] != int(values[1]):
            raise ValueError(f"the fly window must be a whole number, got {spec!r}")
        rule = AcceptRule.fly(values[0], int(values[1]))
    elif name == "kl":
        rule = AcceptRule.kl(*values)
    elif name == "topk":
        if values[0] != int(values[0]):
            raise ValueError(f"the topk k must be a whole number, got {spec!r}")
        rule = AcceptRule.topk(int(values[0]), values[1])
    else:
        rule = AcceptRule()
    from pad_kernels.verify import check_rule

    check_rule(rule, temperature=0.0)  # the ranges (greedy-only is checked where the temperature is known)
    return Policy(name, rule=rule)
