"""Offline vLLM engines with pad's acceptance, for tests and side-by-side benchmarks.

A thin layer over ``vllm.LLM``: a draft model (vLLM's ``draft_model`` speculator) or a draft-free speculator
(``ngram``, ``suffix``), pad's configuration in ``additional_config`` (``pad.serving.vllm``), and the
counters vLLM keeps of its speculation.
"""
from __future__ import annotations

from dataclasses import dataclass


SPECULATORS = ("draft_model", "ngram", "suffix")


def engine(target: str, draft: str | None, *, num_draft_tokens: int = 8, pad: dict | None = None,
           speculator: str | None = None, speculator_args: dict | None = None, dtype: str = "float32",
           seed: int = 0, max_model_len: int = 2048, enforce_eager: bool = True, **kwargs):
    """A ``vllm.LLM`` for ``target`` (a model folder), speculating with ``draft`` (None: target alone).

    speculator: vLLM's speculative ``method``: ``draft_model`` (the default with a draft), or a draft-free one
    with ``draft`` None: ``ngram`` (prompt lookup) or ``suffix`` (SuffixDecoding, needs arctic-inference);
    ``speculator_args``: more of vLLM's speculative config (``prompt_lookup_max``, ...).
    pad: ``additional_config["pad"]`` (for example ``{"policy": "threshold@0.2"}``); None: vLLM unchanged.
    Extra keyword arguments go to ``vllm.LLM`` (``tensor_parallel_size``, ``max_num_seqs``, ...)."""
    speculator = speculator or ("draft_model" if draft is not None else None)
    if speculator not in (None, *SPECULATORS):
        raise ValueError(f"unknown speculator {speculator!r}; vLLM's methods served here: {', '.join(SPECULATORS)}")
    if (speculator == "draft_model") != (draft is not None):
        raise ValueError("a draft model goes with the draft_model speculator only, and it needs one: "
                         f"got speculator {speculator!r} and draft {draft!r}")
    from vllm import LLM

    spec = None
    if speculator is not None:
        spec = {"method": speculator, "num_speculative_tokens": num_draft_tokens, **(speculator_args or {})}
        if draft is not None:
            spec["model"] = draft
    return LLM(model=target, speculative_config=spec, dtype=dtype, seed=seed, max_model_len=max_model_len,
               enforce_eager=enforce_eager, additional_config={"pad": pad} if pad is not None else {},
               disable_log_stats=False, **kwargs)


@dataclass
class SpeculationCounts:
    """vLLM's speculation counters over an engine's life (``vllm:spec_decode_*``)."""

    drafts: int = 0  # verification blocks (one per request and step that had drafts)
    draft_tokens: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    def __sub__(self, other: "SpeculationCounts") -> "SpeculationCounts":
        return SpeculationCounts(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                                 self.accepted - other.accepted)


def speculation_counts(llm) -> SpeculationCounts:
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    counts = SpeculationCounts()
    for metric in llm.get_metrics():
        if metric.name in names:
            setattr(counts, names[metric.name], getattr(counts, names[metric.name]) + int(metric.value))
    return counts


def generate(llm, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
             seed: int | list[int] | None = None, ignore_eos: bool = False,
             extra_args: list[dict | None] | None = None, **sampling) -> list[list[int]]:
    """Token ids in, new token ids out (one list per prompt, in order). ``seed``: one for all, or one per
    prompt; ``extra_args``: per prompt, its ``SamplingParams.extra_args`` (a request's own pad settings:
    ``{"pad": {"policy": ...}}``); more keyword arguments go to every ``SamplingParams`` (``top_k``, ...)."""
    from vllm import SamplingParams

    extra_args = extra_args if extra_args is not None else [None] * len(prompts)
    seeds = seed if isinstance(seed, list) else [seed] * len(prompts)
    if len(extra_args) != len(prompts) or len(seeds) != len(prompts):
        raise ValueError(f"extra_args and a list of seeds: one per prompt ({len(prompts)}), got "
                         f"{len(extra_args)} and {len(seeds)}")
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=s, ignore_eos=ignore_eos,
                             extra_args=extra, **sampling) for extra, s in zip(extra_args, seeds)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def runner(llm):
    """The model runner of an engine whose worker lives in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    executor = getattr(llm.llm_engine, "model_executor", None)  # absent when the engine core is another process
    worker = getattr(executor, "driver_worker", None)
    if worker is None:
        raise RuntimeError("the engine's worker runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return worker.worker.model_runner
