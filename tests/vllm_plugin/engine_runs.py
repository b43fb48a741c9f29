"""Run the vLLM engines a JSON spec lists, one after another in this process, and write what they made.

Usage: python engine_runs.py SPEC.json OUT.json. Engines start in one process because the first costs about
15 s and each later one about 3 s. SPEC: {"target", "k", "dtype", "runs": [{"draft", "pad", "prompts",
"max_tokens", "temperature", "seed", "engine": {...}, "dump_hidden": path, "extra_args": [per prompt],
"bad_requests": [{"extra_args", "temperature"}]}]}.
"""
import gc
import json
import sys

import torch

from pad.serving import engine as vllm_engine


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


def main(spec_path, out_path):
    spec = json.load(open(spec_path))
    results = []
    for run in spec["runs"]:
        llm = vllm_engine.engine(spec["target"], run.get("draft"), num_draft_tokens=spec["k"], pad=run.get("pad"),
                                 dtype=spec.get("dtype", "float32"), max_model_len=512, **run.get("engine", {}))
        refused = []
        for bad in run.get("bad_requests", []):  # each alone, before the run's own requests: refused, engine goes on
            try:
                vllm_engine.generate(llm, [run["prompts"][0]], max_tokens=2, temperature=bad.get("temperature", 0.0),
                                     extra_args=[bad.get("extra_args")])
                refused.append(None)
            except Exception as e:  # noqa: BLE001 - what vLLM raises is the result
                refused.append(f"{type(e).__name__}: {e}")
        tokens = vllm_engine.generate(llm, run["prompts"], max_tokens=run["max_tokens"],
                                      temperature=run.get("temperature", 0.0), seed=run.get("seed"), ignore_eos=True,
                                      extra_args=run.get("extra_args"))
        result = {"tokens": tokens, "counts": vars(vllm_engine.speculation_counts(llm)), "stock": stock(llm),
                  "refused": refused}
        if run.get("dump_hidden"):
            capture = vllm_engine.runner(llm).rejection_sampler._pad.capture
            torch.save(capture.value, run["dump_hidden"])
        try:
            acceptance = getattr(vllm_engine.runner(llm).rejection_sampler, "_pad", None)
            result["relaxed_accepted"] = acceptance.relaxed_accepted if acceptance is not None else None
        except RuntimeError:
            result["relaxed_accepted"] = None
        results.append(result)
        del llm
        gc.collect()
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
