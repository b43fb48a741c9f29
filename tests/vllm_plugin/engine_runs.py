"""Run the vLLM engines a JSON spec lists, one after another in this process, and write what they made.

Usage: python engine_runs.py SPEC.json OUT.json. Engines start in one process because the first costs about
15 s and each later one about 3 s. SPEC: {"target", "k", "dtype", "runs": [{"draft", "speculator",
"speculator_args", "pad", "prompts", "max_tokens", "temperature", "seed" (one, or one per prompt), "sampling":
{more SamplingParams}, "engine": {...}, "dump_hidden": path, "extra_args": [per prompt], "bad_requests":
[{"extra_args", "temperature"}], "record_drafts": bool, "reuse": bool}]}.
``record_drafts``: the drafts each request was given, as [prompt index, context length, drafts] per step;
``fault``: a fault planted in pad's decision, at every step ("every") or at the run's N-th step (N, from 1):
the result's "skipped" counts the steps the plugin's guard gave to vLLM's own rejection sampling, and
"faulted" holds, per faulted step, [the rows the engine used, vLLM's own rejection sampling of that step];
``reuse``: the run decodes on the previous run's engine (its engine keys unread); counts are the run's own.
``compiled_graphs``: torch.compile's graphs so far in this process (the worker's, in one process).
"""
import gc
import json
import sys

import torch

from pad.serving import engine as vllm_engine
from pad.serving import vllm as plugin


def stock(llm) -> dict:
    """Whether the acceptance path is vLLM's own code (only checkable with the worker in this process)."""
    import vllm.v1.sample.rejection_sampler as rs

    own = {"rejection_sample": rs.rejection_sample, "forward": rs.RejectionSampler.forward}
    out = {name: f.__module__ == rs.__name__ and not hasattr(f, "__wrapped__") for name, f in own.items()}
    try:
        sampler = vllm_engine.runner(llm).rejection_sampler
        out["instance"] = "forward" not in sampler.__dict__ and getattr(sampler, "_pad", None) is None
    except RuntimeError:
        pass
    return out


def record_drafts(prompts: list[list[int]], into: list) -> None:
    """Wrap the plugin's acceptance function to note, per step and request, the drafts it decides on."""
    decide = plugin.pad_rejection_sample

    def recording(acceptance, metadata, draft_token_ids, num_draft_tokens, *args, **kwargs):
        drafts, start = draft_token_ids.tolist(), 0
        for r, k in zip(acceptance.runner.input_batch.req_ids, num_draft_tokens):
            state = acceptance.runner.requests[r]
            prompt = list(state.prompt_token_ids)
            into.append([prompts.index(prompt), len(prompt) + len(state.output_token_ids), drafts[start:start + k]])
            start += k
        return decide(acceptance, metadata, draft_token_ids, num_draft_tokens, *args, **kwargs)

    plugin.pad_rejection_sample = recording


def plant_fault(fault, faulted: list) -> None:
    """Make pad's decision raise at every step or at the N-th; note what the guarded step returned beside what
    vLLM's own rejection sampling returns on the same arguments (greedy: deterministic)."""
    import vllm.v1.sample.rejection_sampler as rs

    decide, guarded, own, calls = plugin.pad_rejection_sample, plugin.decide_step, rs.rejection_sample, [0]

    def faulty(*args, **kwargs):
        if fault == "every" or calls[0] == fault:
            raise RuntimeError("a fault planted by the test")
        return decide(*args, **kwargs)

    def watched(acceptance, metadata, *args, **kwargs):
        calls[0] += 1
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        out = guarded(acceptance, metadata, *args, **kwargs)
        if fault == "every" or calls[0] == fault:
            faulted.append([out.tolist(), own(*copies, **kwargs).tolist()])
        return out

    plugin.pad_rejection_sample, plugin.decide_step = faulty, watched


def counter(llm, name: str) -> int | None:
    """One of the plugin's counters of the engine (``relaxed_accepted``, ``relaxed_decisions_skipped``); None
    when pad does not decide there or its worker is in another process."""
    try:
        acceptance = getattr(vllm_engine.runner(llm).rejection_sampler, "_pad", None)
    except RuntimeError:
        return None
    return getattr(acceptance, name) if acceptance is not None else None


def skipped(llm) -> int | None:
    return counter(llm, "relaxed_decisions_skipped")


def relaxed_accepted(llm) -> int | None:
    return counter(llm, "relaxed_accepted")


def main(spec_path, out_path):
    spec = json.load(open(spec_path))
    results, llm = [], None
    for run in spec["runs"]:
        if not run.get("reuse"):
            llm = None
            gc.collect()
            llm = vllm_engine.engine(spec["target"], run.get("draft"), num_draft_tokens=spec["k"],
                                     pad=run.get("pad"), speculator=run.get("speculator"),
                                     speculator_args=run.get("speculator_args"), dtype=spec.get("dtype", "float32"),
                                     max_model_len=512, **run.get("engine", {}))
        refused = []
        for bad in run.get("bad_requests", []):  # each alone, before the run's own requests: refused, engine goes on
            try:
                vllm_engine.generate(llm, [run["prompts"][0]], max_tokens=2, temperature=bad.get("temperature", 0.0),
                                     extra_args=[bad.get("extra_args")])
                refused.append(None)
            except Exception as e:  # noqa: BLE001 - what vLLM raises is the result
                refused.append(f"{type(e).__name__}: {e}")
        counts, relaxed = vllm_engine.speculation_counts(llm), relaxed_accepted(llm)
        recorded, faulted, decide, guarded, skipped_before = [], [], plugin.pad_rejection_sample, plugin.decide_step, \
            skipped(llm)
        if run.get("record_drafts"):
            record_drafts(run["prompts"], recorded)
        if run.get("fault") is not None:
            plant_fault(run["fault"], faulted)
        tokens = vllm_engine.generate(llm, run["prompts"], max_tokens=run["max_tokens"],
                                      temperature=run.get("temperature", 0.0), seed=run.get("seed"), ignore_eos=True,
                                      extra_args=run.get("extra_args"), **run.get("sampling", {}))
        plugin.pad_rejection_sample, plugin.decide_step = decide, guarded
        result = {"tokens": tokens, "counts": vars(vllm_engine.speculation_counts(llm) - counts),
                  "stock": stock(llm), "refused": refused, "drafts": recorded,
                  "relaxed_accepted": None if relaxed is None else relaxed_accepted(llm) - relaxed,
                  "skipped": None if skipped_before is None else skipped(llm) - skipped_before, "faulted": faulted,
                  "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
        if run.get("dump_hidden"):
            capture = vllm_engine.runner(llm).rejection_sampler._pad.capture
            torch.save(capture.value, run["dump_hidden"])
        results.append(result)
    json.dump(results, open(out_path, "w"))

if __name__ == "__main__":
    main(*sys.argv[1:3])
