"""Bad pad request settings of every kind, for the fast tier (``request_policy``) and the vLLM tier (the
server's 400s): ``BAD_SETTINGS`` is a list of (id, extra_args, temperature, the key as the request sent it).

Flat ``pad_*`` keys are what the OpenAI API's ``vllm_xargs`` carries; ``{"pad": ...}`` is ``extra_args``
itself (``vllm_xargs`` can send that key too, with a value that is not an object)."""
import math

VALUES = {"int": 7, "negative": -1, "huge": 10**40, "float": 0.5, "nan": math.nan, "inf": math.inf,
          "list": [1, "a"], "object": {"a": 1}, "null": None, "bool": True, "long-string": "x" * 100_000,
          "unknown-policy": "banana", "bad-window": "fly@0.3,inf", "nan-sigma": "pivot@nan"}
VALID = {"exact_prefix": ("int",), "judge_free": ("bool",)}  # the engine below serves these as they are


def _cases():
    for key in ("policy", "exact_prefix", "judge_free"):
        for name, value in VALUES.items():
            if name not in VALID.get(key, ()):
                yield f"pad_{key}-{name}", {f"pad_{key}": value}, 0.0, f"pad_{key}"
        yield f"nested-{key}-list", {"pad": {key: [1]}}, 0.0, f'extra_args["pad"]["{key}"]'
    for name in ("int", "null", "list", "long-string", "bool"):
        yield f"pad-{name}", {"pad": VALUES[name]}, 0.0, 'extra_args["pad"]'
    for key in ("floor", "classifier", "backend", "sigma"):
        yield f"unknown-pad_{key}", {f"pad_{key}": 0.5}, 0.0, f"pad_{key}"
    yield "unknown-nested", {"pad": {"floor": 0.5}}, 0.0, 'extra_args["pad"]["floor"]'
    yield "both-forms", {"pad": {"policy": "exact"}, "pad_policy": "exact"}, 0.0, 'extra_args["pad"]'
    yield "fly-sampled", {"pad_policy": "fly@0.3,2"}, 0.8, "pad_policy"
    yield "kl", {"pad_policy": "kl@0.5"}, 0.0, "pad_policy"
    yield "judge-free-threshold", {"pad_policy": "threshold@0.2", "pad_judge_free": 1}, 0.0, "pad_judge_free"


def refused_by_vllm_itself(extra_args) -> bool:
    """Whether vLLM refuses the setting before pad reads it: ``SamplingParams`` takes no integer outside 64 bits
    in ``extra_args`` (its MessagePack transport), a 400 naming ``extra_args`` rather than the key."""
    values = list(extra_args.values())
    while values:
        v = values.pop()
        if isinstance(v, dict):
            values.extend(v.values())
        elif isinstance(v, int) and not -(2**63) <= v < 2**64:
            return True
    return False


# The engine the cases are refused by: pivot with a classifier (so judge_free and pivot are servable).
ENGINE = {"pad": {"policy": "pivot@0.3", "classifier": "shipped"}}
BAD_SETTINGS = list(_cases())
