"""End-to-end benchmark: every policy on the same problems, side by side in one process.

Per policy: accuracy (the task's utility), acceptance rate, mean accepted length, target forwards per
generated token, tokens/s and the speedup over the target alone (tokens/s ratio). Policies run in turns
on each problem, so that machine noise hits all of them alike.
"""
from __future__ import annotations

import csv
import math
import textwrap
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..decoding.decoder import left_padded
from ..decoding.draft_length import DEFAULT_MAX_DRAFT_TOKENS
from ..decoding.drafters import NAMES as DRAFTERS
from ..decoding.drafters import NEEDS_MODEL, SuffixDrafter
from ..decoding.generate import DECODE_VERSION, DEFAULT_K, generate, option_conflicts, runs_draft_model
from ..decoding.rows import cut
from ..decoding.policy import Policy, parse_policy
from ..errors import PadError
from ..models.registry import check_weights
from .. import jsonl
from ..machine import machine_line, speed_probe
from . import tasks

# transformers' own generate, as baselines: assisted generation with the draft model, prompt lookup, the target
HF_POLICIES = ("hf-assisted", "hf-lookup", "hf-target")
ONE_AT_A_TIME = ("hf-assisted", "hf-lookup")  # transformers refuses batches there
# New tokens of the untimed decode that precedes each policy's first timed run (lazy initialisation and,
# on GPUs, kernel compilation stay out of the timings).
WARMUP_TOKENS = 8
# Speed probe (``machine.speed_probe``) of the timed runs: retaken every PROBE_EVERY seconds, so that a job
# started beside a long benchmark shows within a few runs; rows whose probes differ by more than PROBE_TOLERANCE
# (the probe's spread on one idle machine is a few percent) were timed at different speeds.
PROBE_EVERY = 300.0
PROBE_TOLERANCE = 0.05


@dataclass
class PolicySpec:
    name: str  # as written: "pivot@0.5"
    policy: str  # "target" | "draft" | "exact" | "pivot" | "typical" | "threshold" | "fly" | "hf-assisted" | "hf-lookup" | "hf-target"
    sigma: float = 0.0
    parsed: Policy | None = None  # for pad.generate's policies
    k: int | str | None = None  # its own draft length ("exact:4", "exact:auto"); None: the bench's
    drafter: str | None = None  # its own drafter ("exact/lookup"); None: the bench's


def parse_policies(text: str) -> list[PolicySpec]:
    """``"target,exact,pivot@0.5,typical@0.09,0.3,exact:4,exact/lookup:auto"`` -> specs; raises ValueError on an
    unknown name or bad settings. Policies are separated by commas; a policy's own settings by commas too, so
    a comma followed by a number continues the policy before it (``typical@0.09,0.3,fly`` is two policies).
    A speculative policy may name its drafter after a slash (``pivot@0.3/hybrid``; else the bench's
    ``--drafter``) and end in ``:K`` or ``:auto``, its own draft length (else the bench's ``-k``):
    ``POLICY[@SETTINGS][/DRAFTER][:K]``."""
    specs, names = [], []
    for part in (t.strip() for t in text.split(",") if t.strip()):
        if (names and "@" in names[-1] and ":" not in names[-1] and "/" not in names[-1]
                and _is_number(part.partition(":")[0].partition("/")[0])):
            names[-1] += "," + part
        else:
            names.append(part)
    for name in names:
        base, _, k_text = name.partition(":")
        k = parse_draft_length(k_text, name) if k_text else None
        base, _, drafter = base.partition("/")
        if drafter and drafter not in DRAFTERS:
            raise ValueError(f"{name}: unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if drafter and base in HF_POLICIES:
            raise ValueError(f"{name}: {base} is transformers' own decoding: it takes no pad drafter")
        if base in HF_POLICIES:
            if k == "auto":
                raise ValueError(f"{name}: transformers' assisted generation runs at a fixed K here (hf-assisted:K)")
            specs.append(PolicySpec(name, base, k=k))
            continue
        try:
            parsed = parse_policy(base)
        except ValueError as e:
            raise ValueError(f"{e}; the benchmark also runs {', '.join(HF_POLICIES)}") from None
        if parsed.name == "pivot" and parsed.sigma is None:
            raise ValueError("write the pivot policy with its sigma: pivot@SIGMA")
        if (k is not None or drafter) and parsed.name in ("target", "draft"):
            raise ValueError(f"{name}: policy {parsed.name} drafts nothing, so it takes no draft length or drafter")
        specs.append(PolicySpec(name, parsed.name, parsed.sigma or 0.0, parsed, k, drafter or None))
    if not specs:
        raise ValueError("no policies given")
    if len({s.name for s in specs}) < len(specs):
        raise ValueError(f"a policy is listed twice in {text!r}")
    return specs


# generate's option names as the bench command spells them
FLAGS = {"drafter": "--drafter", "draft_stop": "--draft-stop", "num_draft_tokens": "-k",
         "max_draft_tokens": "--max-draft-tokens", "temperature": "--temperature", "judge_free": "--judge-free"}


def needs_draft_model(specs: list[PolicySpec], drafter: str = "model") -> bool:
    """Whether any of ``specs`` runs the draft model: the draft alone, transformers' assisted generation, or a
    speculative policy whose drafter (its own, else ``drafter``) is the model or hybrid. The others decode
    with the target alone, so a benchmark of them loads no draft."""
    return any(s.policy == "hf-assisted"
               or (s.policy not in HF_POLICIES and runs_draft_model(s.policy, s.drafter or drafter)) for s in specs)


def check_options(specs: list[PolicySpec], *, num_draft_tokens, max_draft_tokens=None, temperature: float = 0.0,
                  drafter: str = "model", draft_stop: float | None = None, judge_free: bool = False) -> list[str]:
    """Refuse, before any work, the options of a benchmark that cannot run together: ValueError naming both
    (a policy of ``--policies`` by its name). An option that would change nothing (``--draft-stop`` where no
    policy drafts with a model, ``--judge-free`` without a pivot policy, ``--max-draft-tokens`` without an auto
    K) is refused too. Returns notes on how a combination runs (transformers' baselines under ``-k auto``)."""
    notes = []
    for spec in specs:
        k = spec.k if spec.k is not None else num_draft_tokens
        if spec.policy in HF_POLICIES:
            if temperature > 0:
                raise ValueError(f"{spec.name} in --policies with --temperature: transformers' baselines run greedy "
                                 "here; leave them out when sampling")
            if k == "auto":
                notes.append(f"{spec.name} runs at K = {DEFAULT_K} under -k auto (transformers' assisted generation "
                             f"takes a fixed K; {spec.policy}:K sets another)")
            continue
        speculating = spec.policy not in ("target", "draft")
        chosen = (spec.drafter or drafter) if speculating else None
        for a, b, why in option_conflicts(
                spec.parsed, drafter=chosen, draft_stop=draft_stop if chosen in NEEDS_MODEL else None,
                num_draft_tokens=k, max_draft_tokens=max_draft_tokens if k == "auto" else None,
                temperature=temperature, judge_free=judge_free and spec.policy == "pivot"):
            named = [f"{spec.name} in --policies" if o == "policy" else
                     (f"{spec.name}'s drafter" if o == "drafter" and spec.drafter else FLAGS[o]) for o in (a, b)]
            raise ValueError(f"{named[0]} with {named[1]}: {why}")
    speculative = [s for s in specs if s.policy not in ("target", "draft", *HF_POLICIES)]
    if draft_stop is not None and not needs_draft_model(speculative, drafter):
        raise ValueError(f"--draft-stop with --policies {','.join(s.name for s in specs)}: --draft-stop stops a draft "
                         "model's drafting, and no policy here drafts with one (model or hybrid drafter)")
    if judge_free and not any(s.policy == "pivot" for s in specs):
        raise ValueError("--judge-free with --policies without a pivot policy: it tells pivot's classifier to judge "
                         "draft-free drafts, and no policy here has one")
    if max_draft_tokens is not None and not any((s.k if s.k is not None else num_draft_tokens) == "auto"
                                                for s in speculative):
        raise ValueError("--max-draft-tokens with a fixed -k: it caps -k auto (or a policy's :auto), and no policy "
                         "here chooses its K")
    return notes


def parse_draft_length(text: str, where: str = "") -> int | str:
    """``"8"`` -> 8, ``"auto"`` -> "auto"; raises ValueError otherwise."""
    text = str(text).strip().lower()
    if text == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"a draft length is an integer >= 1 or 'auto', got {text!r}"
                         + (f" in {where!r}" if where else ""))
    return k


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


@dataclass
class PolicyTotals:
    problems: int = 0
    correct: int = 0
    scored: int = 0  # problems with a right or wrong answer (none on a task without answers)
    new_tokens: int = 0
    wall_time: float = 0.0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    row_blocks: int = 0  # blocks summed over rows (each row counts the blocks it took part in)
    row_block_drafts: int = 0  # their K summed
    predicted_time: float = 0.0  # auto K: the chooser's predicted block seconds and the measured ones
    timed_blocks_time: float = 0.0
    batch_size: int = 0  # the largest batch its problems were decoded in
    peak_mib: float = math.nan  # the largest peak resident memory of a timed run
    probed_seconds: float = 0.0  # wall time of the runs whose log record has a speed probe
    probe_x_seconds: float = 0.0  # their probes weighted by that time, as tokens/s weighs them
    probe_low: float = math.inf  # the lowest and highest probe of its runs
    probe_high: float = 0.0
    unprobed: int = 0  # runs logged without a probe

    def add(self, record: dict) -> None:
        self.problems += 1
        self.batch_size = max(self.batch_size, record.get("batch_size", 1))
        peak = record.get("peak_mib", math.nan)
        self.peak_mib = peak if math.isnan(self.peak_mib) else max(self.peak_mib, peak)
        if record["correct"] is not None:
            self.correct += record["correct"]
            self.scored += 1
        self.new_tokens += record["new_tokens"]
        self.wall_time += record["seconds"]
        self.target_forwards += record["target_forwards"]
        self.drafted += record["drafted"]
        self.accepted += record["accepted"]
        lengths = {int(k): n for k, n in record.get("draft_lengths", {}).items()}
        self.row_blocks += sum(lengths.values())
        self.row_block_drafts += sum(k * n for k, n in lengths.items())
        self.predicted_time += record.get("predicted_time", 0.0)
        self.timed_blocks_time += record.get("timed_blocks_time", 0.0)
        if "speed_probe" in record:
            self.probed_seconds += record["seconds"]
            self.probe_x_seconds += record["speed_probe"] * record["seconds"]
            self.probe_low = min(self.probe_low, record["speed_probe"])
            self.probe_high = max(self.probe_high, record["speed_probe"])
        else:
            self.unprobed += 1

    def row(self, name: str) -> dict:
        tps = self.new_tokens / self.wall_time if self.wall_time else math.nan
        nan = math.nan
        return {
            "policy": name,
            "problems": self.problems,
            "accuracy": self.correct / self.scored if self.scored else nan,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else nan,
            "mean_accepted_length": self.new_tokens / self.target_forwards if self.target_forwards else nan,
            "target_forwards_per_token": (self.target_forwards / self.new_tokens
                                          if self.new_tokens else nan),
            "new_tokens": self.new_tokens,
            "tokens_per_s": tps,
            "mean_draft_length": self.row_block_drafts / self.row_blocks if self.row_blocks else nan,
            # auto K: predicted / measured time of the chosen blocks (1.0 = the cost model was right on average)
            "predicted_vs_measured": (self.predicted_time / self.timed_blocks_time if self.timed_blocks_time
                                      else nan),
            "speedup_vs_target": nan,  # set by summary_rows, against the target row's comparable speed
            "batch_size": self.batch_size,
            "peak_mib": self.peak_mib,
            # the machine's speed when its runs were timed (``machine.speed_probe``; NaN for older logs)
            "speed_probe": self.probe_x_seconds / self.probed_seconds if self.probed_seconds else nan,
            # its own runs were timed at speeds that do not compare (probes apart, or some without one)
            "probe_mixed": bool(self.probed_seconds and (self.unprobed or self.probe_high > self.probe_low
                                                          * (1 + PROBE_TOLERANCE))),
        }


# transformers reads the draft length from the assistant's own generation config and ignores it as a
# generate() argument; its defaults (20 tokens, stop drafting below 0.4 confidence) are another algorithm.
# The hf-assisted row runs plain speculative decoding at the bench's K, like the exact policy.
HF_ASSISTED = {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}


def _hf_assisted(target, draft, ids, k, max_new_tokens, eos) -> tuple[list[int], float, int]:
    """transformers' assisted generation at K draft tokens -> (new tokens, seconds, target forwards); with
    ``draft`` None its prompt lookup decoding (``prompt_lookup_num_tokens=K``, its own n-gram settings)."""
    if draft is None:
        return _hf_generate(target, ids, max_new_tokens, eos, prompt_lookup_num_tokens=k)
    config = draft.generation_config
    saved = {key: getattr(config, key, None) for key in ("num_assistant_tokens", *HF_ASSISTED)}
    try:
        for key, value in {"num_assistant_tokens": k, **HF_ASSISTED}.items():
            setattr(config, key, value)
        return _hf_generate(target, ids, max_new_tokens, eos, assistant_model=draft)
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


def _hf_generate(target, ids, max_new_tokens, eos, **extra) -> tuple[list[int], float, int]:
    """One greedy ``target.generate`` of one row -> (new tokens, seconds, target forwards)."""
    rows, seconds, forwards = _hf_batch(target, ids, torch.ones_like(ids), max_new_tokens, eos,
                                        eos[0] if eos else 0, **extra)
    return rows[0], seconds, forwards


def _hf_batch(target, ids, mask, max_new_tokens, eos, pad, **extra) -> tuple[list[list[int]], float, int]:
    """transformers' greedy ``target.generate`` of a left-padded batch -> (new tokens per row, each cut after
    its EOS, seconds, target forwards)."""
    forwards = [0]
    hook = target.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    try:
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                              eos_token_id=eos, pad_token_id=pad, **extra)
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    # finished rows are padded after their EOS
    rows = [cut(row, max_new_tokens, eos or ())[0] for row in out[:, ids.shape[1]:].tolist()]
    return rows, seconds, forwards[0]


class RunLog:
    """Append-only JSONL of finished (problem, policy) runs, so that a long benchmark survives a kill.

    A record is reused only when its ``settings`` equal this run's (task, prompt fingerprint, utility
    version, decode-path version, models and their weights, dtype, K, token budget, machine line, for
    pivot policies the classifier's checksum and floor, for hf-assisted its draft-length settings); each
    line is fsync'd. A log that holds runs of other weights is refused; ``run`` warns of runs it does again
    because their logged settings differ (``note_rerun``).
    """

    def __init__(self, path: Path | None):
        self.path = path
        self.records: list[dict] = jsonl.read(path) if path is not None else []  # a torn last line is redone
        self.told: set[str] = set()  # policies named by note_rerun

    def find(self, settings: dict, problem: str, policy: str) -> dict | None:
        for r in self.records:
            if r["problem"] == problem and r["policy"] == policy and r["settings"] == settings:
                return r
        return None

    def differences(self, settings: dict, problem: str, policy: str) -> dict:
        """Where the logged run of ``policy`` on ``problem`` closest to ``settings`` differs from them ->
        {key: (logged, wanted)}; {} when the log holds no run of them (or one that ``find`` reuses)."""
        closest = None
        for r in self.records:
            if r["problem"] == problem and r["policy"] == policy:
                s = r["settings"]
                diff = {k: (s.get(k), settings.get(k)) for k in sorted(s.keys() | settings.keys())
                        if s.get(k) != settings.get(k)}
                if closest is None or len(diff) < len(closest):
                    closest = diff
        return closest or {}

    def note_rerun(self, settings: dict, problem: str, policy: str) -> None:
        """Warn, once per policy, that its logged runs under other settings are done again, naming each setting
        that differs for ``problem``: a rerun of hours should not pass unnoticed (a library upgrade changes the
        machine line)."""
        diff = {} if policy in self.told else self.differences(settings, problem, policy)
        if diff:
            self.told.add(policy)
            warnings.warn(f"run log {self.path} holds {policy} on {problem} under other settings ("
                          + "; ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in diff.items())
                          + "): such runs are done again, not reused", stacklevel=3)

    def add(self, record: dict) -> None:
        self.records.append(record)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            jsonl.append(self.path, record)


def run(task: str, problems: list, target, draft, tokenizer, specs: list[PolicySpec], *,
        num_draft_tokens: int | str, max_new_tokens: int, classifier=None, floor: float = 1e-4, progress: bool = True,
        settings: dict | None = None, log: Path | None = None, models=None, batch_size: int = 1,
        draft_stop: float | None = None, max_draft_tokens: int | None = None, temperature: float = 0.0,
        top_p: float = 1.0, seed: int = 0, drafter: str = "model", judge_free: bool = False) -> list[dict]:
    """Run every policy on every problem; returns one summary row per policy (see ``PolicyTotals.row``).

    Problems go ``batch_size`` at a time through each policy in turn (``hf-assisted`` and ``hf-lookup`` one at
    a time: transformers refuses batches there); accuracy and acceptance stay per problem, tokens/s is aggregate.
    With ``log``, finished runs are appended there and runs already in it (same ``settings``) are not
    repeated: an interrupted benchmark resumes, and baseline runs survive a new classifier. ``models``: a
    callable returning (target, draft), called the first time a run is missing, in place of ``target`` and
    ``draft`` (so a table of logged runs is printed without loading any weights). ``num_draft_tokens``: K of
    the policies without their own (``PolicySpec.k``); ``"auto"`` with ``max_draft_tokens`` as in ``generate``.
    ``drafter``: that of the speculative policies without their own (``PolicySpec.drafter``). ``judge_free``:
    the pivot policies' classifier also judges draft-free proposals (``generate``'s ``judge_free``).
    ``temperature`` > 0 samples (with ``top_p``); each batch of problems draws from its own generator, seeded by
    ``seed`` and its first problem (``group_seed``), so a run repeats whatever ran before it in the process.
    """
    from tqdm.auto import tqdm

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be an integer >= 1, got {batch_size!r}")
    check_options(specs, num_draft_tokens=num_draft_tokens, max_draft_tokens=max_draft_tokens,
                  temperature=temperature, drafter=drafter, draft_stop=draft_stop, judge_free=judge_free)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    runs = RunLog(log)
    for r in runs.records:
        check_weights(r["settings"].get("weights") or {}, (settings or {}).get("weights") or {}, f"run log {log}")
    base = {**(settings or {}), "task": task, "prompt": tasks.prompt_fingerprint(task),
            "utility": tasks.UTILITY_VERSION[task], "decode": DECODE_VERSION, "k": num_draft_tokens,
            "max_new_tokens": max_new_tokens, "machine": machine_line(with_commit=False)}
    if draft_stop is not None:  # absent otherwise, so that the logs of fixed-length runs stay valid
        base["draft_stop"] = draft_stop
    sampling = {"temperature": temperature, "top_p": top_p, "seed": seed} if temperature > 0 else {}
    base.update(sampling)  # absent when greedy, so that the greedy logs stay valid
    extra = {"pivot": {"classifier": classifier.checksum() if classifier is not None else None, "floor": floor},
             "hf-assisted": {"hf_assisted": HF_ASSISTED}}
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
    totals = {s.name: PolicyTotals() for s in specs}
    logged: dict[str, dict[str, dict]] = {s.name: {} for s in specs}  # policy -> problem -> record
    warm = set()  # policies warmed up in this process
    probe, probed_at = None, -math.inf  # the speed probe, retaken every PROBE_EVERY seconds of fresh runs
    bar = tqdm(total=len(problems) * len(specs), desc=f"bench {task}", unit="run", disable=not progress)
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        for spec in specs:
            size = 1 if spec.policy in ONE_AT_A_TIME else len(chunk)
            k = spec.k if spec.k is not None else num_draft_tokens
            if spec.policy in HF_POLICIES and k == "auto":  # a fixed K for transformers (check_options' note)
                k = DEFAULT_K
            spec_drafter = None
            if spec.policy not in HF_POLICIES and spec.policy not in ("target", "draft"):
                spec_drafter = spec.drafter or drafter
            for group in (chunk[i : i + size] for i in range(0, len(chunk), size)):
                key = {**base, **extra.get(spec.policy, {}), "k": k,
                       "batch_size": 1 if spec.policy in ONE_AT_A_TIME else batch_size}
                if spec_drafter not in (None, "model"):  # absent for the draft model, so older logs stay valid
                    key["drafter"] = spec_drafter
                    if spec_drafter == "suffix":  # logs of a process-wide suffix drafter are never reused
                        key["suffix_counts"] = "per batch"
                    if spec.policy == "pivot":  # absent in logs of before the choice: never reused
                        key["judge_free"] = judge_free
                if k == "auto":
                    key["max_draft_tokens"] = max_draft_tokens or DEFAULT_MAX_DRAFT_TOKENS
                found = [runs.find(key, p.id, spec.name) for p in group]
                if any(r is None for r in found):
                    runs.note_rerun(key, next(p.id for p, r in zip(group, found) if r is None), spec.name)
                    if target is None:
                        target, draft = models()
                    if time.monotonic() - probed_at > PROBE_EVERY:
                        probe = round(speed_probe(str(next(target.parameters()).dtype).removeprefix("torch.")), 1)
                        probed_at = time.monotonic()
                    ids = [tasks.prompt_ids(tokenizer, task, p)[0].tolist() for p in group]
                    how = _Decoding(target, draft, tokenizer, classifier, floor, eos, draft_stop, max_draft_tokens,
                                    sampling, judge_free)
                    if spec.name not in warm:
                        _run_group(task, group, spec, ids, how, k, spec_drafter, min(WARMUP_TOKENS, max_new_tokens),
                                   score=False)
                        warm.add(spec.name)
                    fresh = _run_group(task, group, spec, ids, how, k, spec_drafter, max_new_tokens)
                    for i, (p, record) in enumerate(zip(group, fresh)):
                        if found[i] is None:  # counted as logged, so a table from the log alone is the same
                            found[i] = {"problem": p.id, "policy": spec.name, "settings": key, "speed_probe": probe,
                                        **record}
                            runs.add(found[i])
                    note = f"{spec.name}: {sum(r['new_tokens'] for r in fresh)} tok in " \
                           f"{sum(r['seconds'] for r in fresh):.1f}s"
                else:
                    note = f"{spec.name}: from {log.name}"
                for p, record in zip(group, found):
                    totals[spec.name].add(record)
                    logged[spec.name][p.id] = record
                bar.update(len(group))
                bar.set_postfix_str(note)
    bar.close()
    correct = {name: list(map(bool, v)) for name, v in _per_problem(logged, problems, "correct").items()}
    return summary_rows(totals, correct, replies=_per_problem(logged, problems, "reply"))


def _per_problem(logged: dict[str, dict[str, dict]], problems: list, field: str) -> dict[str, list]:
    """policy -> its records' ``field`` over ``problems`` in order, for the policies that have it for every one
    (unscored runs have no outcome; runs logged before replies were kept have no reply)."""
    values = {name: [by[p.id].get(field) if p.id in by else None for p in problems] for name, by in logged.items()}
    return {name: v for name, v in values.items() if None not in v}


def summary_rows(totals: dict[str, PolicyTotals], correct: dict[str, list], reference: str = "target",
                 replies: dict[str, list[str]] | None = None) -> list[dict]:
    """One ``PolicyTotals.row`` per policy, in the order of ``totals``, each with its speedup over the policy
    named "target" and its accuracy difference from ``reference`` (paired over the same problems:
    ``correct[name]`` lists every policy's outcomes in one order), split into the problems it lost (the
    reference right, the policy wrong) and gained (the reverse); NaN where there is no reference.
    ``replies[name]``, in the same order: each row also counts the replies equal to the reference's, word for
    word (``same_reply_vs_target`` of ``replies_compared``): how often a relaxed rule changed the text at all,
    which outcomes alone do not show.

    Outcomes are bools (one run a problem: the exact McNemar interval, ``paired_difference``) or each
    problem's share of right answers over several sampled runs (seeds pooled per problem: the t interval
    over problems, ``paired_mean_difference``; lost / gained then count the problems whose share fell / rose).
    The differences are stored as ``accuracy_vs_target*`` whatever the reference, which ``reference`` names."""
    rows = comparable_speeds([t.row(name) for name, t in totals.items()])
    target_tps = next((r["tokens_per_s"] for r in rows if r["policy"] == "target"), math.nan)
    for row in rows:
        row["speedup_vs_target"] = row["tokens_per_s"] / target_tps if not math.isnan(target_tps) else math.nan
    for row in rows:
        if reference in correct:
            ours, theirs = correct[row["policy"]], correct[reference]
            shares = any(not isinstance(v, bool) for v in (*ours, *theirs))
            diff, low, high = (paired_mean_difference if shares else paired_difference)(ours, theirs)
            lost = sum(c < t for c, t in zip(ours, theirs))
            gained = sum(c > t for c, t in zip(ours, theirs))
        else:
            diff = low = high = lost = gained = math.nan
        row.update(accuracy_vs_target=diff, accuracy_vs_target_low=low, accuracy_vs_target_high=high,
                   lost_vs_target=lost, gained_vs_target=gained, reference=reference,
                   interval="t over problems" if reference in correct and shares else "McNemar")
        if replies is not None and reference in replies and row["policy"] in replies:
            ours, theirs = replies[row["policy"]], replies[reference]
            if len(ours) != len(theirs):
                raise ValueError(f"{row['policy']} has {len(ours)} replies and {reference} {len(theirs)}: "
                                 "replies are compared over the same problems")
            row.update(same_reply_vs_target=sum(a == b for a, b in zip(ours, theirs)), replies_compared=len(ours))
        else:
            row.update(same_reply_vs_target=math.nan, replies_compared=math.nan)
    return rows


def summary_line(rows: list[dict], table=None) -> str:
    """The line a benchmark ends with: its fastest policy against the target (accuracy beside it), and where
    the table was written."""
    timed = [r for r in rows if r["policy"] != "target" and not _missing(r["tokens_per_s"])]
    where = f"; table: {table}" if table is not None else " (--out DIR writes the tables)"
    if not timed:
        return "no policy but the target was timed" + where
    best = max(timed, key=lambda r: r["tokens_per_s"])
    speed = f"{best['tokens_per_s']:.2f} tokens/s"
    if not _missing(best["speedup_vs_target"]):
        speed = f"{best['speedup_vs_target']:.2f}x the target ({speed})"
    accuracy = "" if _missing(best.get("accuracy_vs_target", math.nan)) else \
        f", accuracy {100 * best['accuracy_vs_target']:+.1f} points against the target"
    return f"fastest here: {best['policy']} at {speed}{accuracy}{where}"


def comparable_speeds(rows: list[dict]) -> list[dict]:
    """Leave out (NaN, ``speed_left_out``) the tokens/s of rows timed on another machine than the rest, so that
    no table or plot compares speeds across machines. The reference is the target row's speed probe, else the
    median probe; a row stays when its probe is within PROBE_TOLERANCE of it and its own runs agree (all
    probed, none apart). A row without a probe stays only when no row has one (logs older than the probe:
    nothing to check against)."""
    probes = sorted(r["speed_probe"] for r in rows if not math.isnan(r["speed_probe"]))
    target = next((r for r in rows if r["policy"] == "target"), None)
    if target is not None and not math.isnan(target["speed_probe"]):
        reference = target["speed_probe"]
    else:
        reference = probes[len(probes) // 2] if probes else math.nan
    for r in rows:
        if math.isnan(reference):
            keep = math.isnan(r["speed_probe"])
        else:
            keep = not r["probe_mixed"] and abs(r["speed_probe"] / reference - 1) <= PROBE_TOLERANCE
        r["speed_left_out"] = not keep and not math.isnan(r["tokens_per_s"])
        if not keep:
            r["tokens_per_s"] = math.nan
    return rows


def paired_difference(a: list[bool], b: list[bool], level: float = 0.95):
    """Accuracy of ``a`` minus that of ``b`` over the same n problems, with the exact McNemar interval
    -> (difference, low, high).

    Only the m problems whose two outcomes differ carry information: given m, the number x of them where
    only ``a`` is right is Binomial(m, pi), and the difference is (m / n)(2 pi - 1). The interval is the
    Clopper-Pearson interval of pi mapped through that line, so it excludes 0 exactly when the exact
    McNemar test rejects. (A percentile bootstrap over problems claimed [+1, +1] for 5 wins out of 5.)"""
    if len(a) != len(b) or not a:
        raise ValueError("paired outcomes need the same, non-empty list of problems")
    x = sum(1 for u, v in zip(a, b) if u and not v)
    m = x + sum(1 for u, v in zip(a, b) if v and not u)
    if m == 0:
        return 0.0, 0.0, 0.0
    low, high = clopper_pearson(x, m, level)
    n = len(a)
    return (2 * x - m) / n, m / n * (2 * low - 1), m / n * (2 * high - 1)


def paired_mean_difference(a: list[float], b: list[float], level: float = 0.95):
    """Mean of ``a`` minus ``b`` over the same n problems, each entry a problem's share of right answers over
    several sampled runs, with the Student t interval of the mean per-problem difference -> (difference, low,
    high). The runs of one problem are pooled first: they are not independent problems."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("paired shares need the same list of at least two problems")
    n = len(a)
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / n
    half = _t_quantile(1 - (1 - level) / 2, n - 1) * math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    return mean, mean - half, mean + half


def _t_quantile(p: float, df: int) -> float:
    """Student t quantile: exact at 1 and 2 degrees of freedom, beyond by the Cornish-Fisher expansion around
    the normal quantile (Abramowitz & Stegun 26.7.5; at p = 0.975 within 4e-3 of the exact value at 3 degrees,
    2e-4 from 6 on, 2e-5 from 10 on)."""
    from statistics import NormalDist

    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    x = NormalDist().inv_cdf(p)
    g = ((x ** 3 + x) / 4, (5 * x ** 5 + 16 * x ** 3 + 3 * x) / 96,
         (3 * x ** 7 + 19 * x ** 5 + 17 * x ** 3 - 15 * x) / 384,
         (79 * x ** 9 + 776 * x ** 7 + 1482 * x ** 5 - 1920 * x ** 3 - 945 * x) / 92160)
    return x + sum(gi / df ** (i + 1) for i, gi in enumerate(g))


def clopper_pearson(x: int, m: int, level: float = 0.95) -> tuple[float, float]:
    """Exact interval of a binomial proportion from x successes in m trials: the lower bound is the pi with
    P(X >= x) = (1 - level) / 2, the upper the pi with P(X <= x) = (1 - level) / 2."""
    if m < 1 or not 0 <= x <= m:
        raise ValueError(f"need m >= 1 and 0 <= x <= m, got x={x}, m={m}")
    tail = (1 - level) / 2
    low = 0.0 if x == 0 else _decreasing_root(lambda pi: _binomial_cdf(x - 1, m, pi) - (1 - tail))
    high = 1.0 if x == m else _decreasing_root(lambda pi: _binomial_cdf(x, m, pi) - tail)
    return low, high


def share_with_interval(x: int, m: int) -> str:
    """``x`` of ``m`` as "x/m = 12.3% [lo, hi]" with the exact 95% interval; "n/a" when m is 0."""
    if not m:
        return "n/a"
    lo, hi = clopper_pearson(x, m)
    return f"{x}/{m} = {x / m:.1%} [{lo:.1%}, {hi:.1%}]"


def _binomial_cdf(x: int, m: int, pi: float) -> float:
    """P(X <= x) for X ~ Binomial(m, pi), 0 < pi < 1, summed in log space (no overflow for large m)."""
    log_c = math.lgamma(m + 1)
    return min(1.0, sum(math.exp(log_c - math.lgamma(k + 1) - math.lgamma(m - k + 1)
                                 + k * math.log(pi) + (m - k) * math.log1p(-pi)) for k in range(x + 1)))


def _decreasing_root(f) -> float:
    """The pi in (0, 1) where the decreasing f crosses 0, by bisection to double precision."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def _reset_peak_memory() -> None:
    try:  # Linux: writing 5 resets the peak resident set size (VmHWM) of this process
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_memory_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def group_seed(seed: int, first_problem: str) -> int:
    """The seed of a sampled batch: fixed by the run's seed and the batch's first problem (its composition is
    fixed by --start, --limit and --batch-size), not by what the process ran before."""
    return zlib.crc32(f"{seed}/{first_problem}".encode())


@dataclass(frozen=True)
class _Decoding:
    """What every run of a bench shares: the models, the classifier and its floor, the EOS ids, the draft
    stop and auto K's longest block (None: the defaults), ``sampling`` (temperature, top_p and seed; empty:
    greedy) and whether pivot's classifier judges draft-free proposals."""
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object
    classifier: object
    floor: float
    eos: list[int] | None
    draft_stop: float | None
    max_draft_tokens: int | None
    sampling: dict
    judge_free: bool = False


def _run_group(task, group, spec, ids, how: _Decoding, k, drafter: str | None, max_new_tokens: int, *,
               score: bool = True) -> list[dict]:
    """One policy on a group of problems decoded as one batch -> one record per problem (the counts a
    PolicyTotals adds up; ``seconds`` and, with auto K, the predicted and measured block times are the
    batch's split evenly over its rows). ``score=False``: a warm-up, not scored. ``drafter``: the speculative
    policies' drafter."""
    target, draft, tokenizer, eos, sampling = how.target, how.draft, how.tokenizer, how.eos, how.sampling
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    batch, mask = left_padded(ids, pad)
    _reset_peak_memory()
    if spec.policy in ONE_AT_A_TIME:
        new, seconds, forwards = _hf_assisted(target, draft if spec.policy == "hf-assisted" else None, batch, k,
                                              max_new_tokens, eos)
        rows = [(new, {"target_forwards": forwards, "drafted": 0, "accepted": 0})]
    elif spec.policy == "hf-target":
        news, seconds, forwards = _hf_batch(target, batch, mask, max_new_tokens, eos, pad)
        rows = [(new, {"target_forwards": forwards, "drafted": 0, "accepted": 0}) for new in news]
    else:
        # A suffix drafter of the batch's own: one kept across runs would hold the replies other policies (and
        # the warm-up) gave to these very problems and copy them; a fresh one also makes a resumed run decode
        # as an uninterrupted one.
        proposer = SuffixDrafter() if drafter == "suffix" else drafter
        result = generate(target, draft, batch, attention_mask=mask, policy=spec.parsed,
                          classifier=how.classifier if spec.policy == "pivot" else None, floor=how.floor,
                          num_draft_tokens=k, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                          draft_stop=how.draft_stop if drafter in ("model", "hybrid") else None,
                          max_draft_tokens=how.max_draft_tokens if k == "auto" else None, drafter=proposer,
                          judge_free=how.judge_free and spec.policy == "pivot",
                          **({"temperature": sampling["temperature"], "top_p": sampling["top_p"],
                              "seed": group_seed(sampling["seed"], group[0].id)} if sampling else {}))
        seconds, P, total = result.stats.wall_time, batch.shape[1], result.stats
        rows = [(result.sequences[i, P : P + int(result.lengths[i])].tolist(),
                 {"target_forwards": s.target_forwards, "drafted": s.drafted, "accepted": s.accepted,
                  "draft_lengths": s.draft_lengths, "predicted_time": total.predicted_time / len(group),
                  "timed_blocks_time": total.timed_blocks_time / len(group)})
                for i, s in enumerate(result.row_stats)]
    peak = _peak_memory_mib()
    records = []
    for problem, (new, counts) in zip(group, rows):
        reply = tokenizer.decode(new, skip_special_tokens=True)
        right = tasks.correct(task, problem, reply) if score else None
        records.append({"correct": bool(right) if right is not None else None,
                        "new_tokens": len(new), "seconds": seconds / len(group), **counts, "batch_size": len(group),
                        "peak_mib": peak,
                        "reply": reply})  # kept in the run log, so that every accuracy figure can be audited
    return records


COLUMNS = [("policy", "policy", "{}"), ("accuracy", "accuracy", "{:.1%}"), ("acceptance_rate", "acceptance", "{:.1%}"),
           ("mean_accepted_length", "tokens / target forward", "{:.2f}"),
           ("target_forwards_per_token", "target forwards / token", "{:.3f}"), ("tokens_per_s", "tokens/s", "{:.2f}"),
           ("speedup_vs_target", "speedup vs target", "{:.2f}x"), ("accuracy_vs_target", "accuracy - target [95% CI]", None),
           ("lost_vs_target", "lost / gained", None), ("same_reply_vs_target", "replies = target", None),
           ("mean_draft_length", "mean K", "{:.2f}"),
           ("new_tokens", "new tokens", "{}"),
           ("batch_size", "batch", "{}"), ("peak_mib", "peak MiB", "{:.0f}"),
           ("speed_probe", "probe GFLOP/s", "{:.0f}")]


def _missing(x) -> bool:
    return isinstance(x, float) and math.isnan(x)  # a row without this figure (the draft's tokens per forward)


def markdown(rows: list[dict], header: str) -> str:
    def cell(row, key, fmt):
        value = row.get(key, math.nan)  # rows of older tables lack newer columns
        if _missing(value):
            return "n/a"
        if key == "accuracy_vs_target":  # points, with the paired interval
            return (f"{100 * value:+.1f} [{100 * row['accuracy_vs_target_low']:+.1f}, "
                    f"{100 * row['accuracy_vs_target_high']:+.1f}]")
        if key == "lost_vs_target":
            return f"{value} / {row['gained_vs_target']}"
        if key == "same_reply_vs_target":
            return f"{value} / {row['replies_compared']}"
        return fmt.format(value)

    reference = rows[0].get("reference", "target") if rows else "target"
    names = [c[1].replace("- target", f"- {reference}").replace("= target", f"= {reference}") for c in COLUMNS]
    lines = [header, "", "| " + " | ".join(names) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, key, fmt) for key, _, fmt in COLUMNS) + " |" for r in rows]
    who = "the target alone" if reference == "target" else reference
    if rows and rows[0].get("interval") == "t over problems":
        note = (f"Accuracy is the mean over the seeds; differences are in points, against {who} on the same problems "
                "and seeds, with the Student t 95% interval over problems of each problem's difference in its share "
                "of right answers over the seeds (the seeds of a problem pooled); lost / gained: the problems whose "
                f"share is lower than {who}'s, and higher. ")
    else:
        note = (f"Accuracy differences are in points, against {who} on the same problems, with the exact "
                "McNemar 95% interval (Clopper-Pearson over the problems whose two outcomes differ); lost / gained: "
                f"the problems {who} solves and the policy does not, and the reverse. ")
    if any(not _missing(r.get("same_reply_vs_target", math.nan)) for r in rows):
        note += f"Replies = {reference}: the policy's replies equal to {who}'s, word for word, of those compared. "
    note += ("Probe: the machine's speed on a fixed matmul when the row's runs were timed (`pad.machine.speed_probe`,"
             " weighted by run time; n/a for runs logged before it existed).")
    left_out = [r["policy"] for r in rows if r.get("speed_left_out")]
    if left_out:
        note += (f"\n\n**Tokens/s left out (n/a) for {', '.join(left_out)}: timed on a machine of another speed "
                 f"than the rest (probes more than {PROBE_TOLERANCE:.0%} apart, beside another job, or without a "
                 "probe), so they do not compare with these rows; rerun them side by side.**")
    elif all(_missing(r["speed_probe"]) for r in rows) and any(not _missing(r["tokens_per_s"]) for r in rows):
        note += "\n\nNo row has a speed probe (logs older than it): that the speeds come from one machine is unchecked."
    return "\n".join(lines) + "\n\n" + note + "\n"


def write(rows: list[dict], out_dir: Path, stem: str, header: str, plot: bool = False) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.csv", out_dir / f"{stem}.md"]
    with open(paths[0], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    paths[1].write_text(markdown(rows, header))
    if plot:
        paths.append(_plot(rows, out_dir / f"{stem}.png", header))
    return paths


PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _rule_and_k(policy: str) -> tuple[str, str]:
    """A table row's policy -> its rule and its drafter (when named) with K: ``"typical@0.09,0.3 K=16"`` ->
    ``("typical", "K=16")``, ``"pivot@0.3/hybrid K=8"`` -> ``("pivot", "/hybrid K=8")``, so that one rule with two
    drafters is two curves, and ``exact/lookup`` is exact."""
    name, _, k = policy.partition(" ")
    base, slash, drafter = name.partition("/")
    return base.split("@")[0], f"{slash}{drafter} {k}".strip()


def point_labels(rows, key: str) -> list[tuple[float, float, str]]:
    """One ``(x, y, label)`` per point of the plot against ``key``; policies whose points coincide (to the
    precision the tables print: x to 2 decimals, accuracy to 0.1 point) share one label ``"a = b"``, so their
    names do not print over each other."""
    points: dict[tuple[float, float], list] = {}
    for r in rows:
        x, y = r[key], r["accuracy"]
        if _missing(x):
            continue
        points.setdefault((round(x, 2), round(y, 3)), [x, y, []])[2].append(r["policy"])
    return [(x, y, " = ".join(names)) for x, y, names in points.values()]


def label_offsets(anchors, sizes, right: float = math.inf, gap: float = 3.0) -> list[tuple[float, float]]:
    """Offsets (dx, dy) of each label's lower left corner from its point, so that no label covers another.

    anchors: [(x, y)] of the points, sizes: [(width, height)] of the labels, ``right``: where the labels must
    end, all in points (1/72 inch, y up). Labels are placed from the top point down: each goes up-right of
    its point (up-left when it would pass ``right``) where that is free, else at the nearest free place
    straight above or below, in steps of its height. -> [(dx, dy)]."""
    placed: list[tuple[float, float, float, float]] = []
    out: list[tuple[float, float] | None] = [None] * len(anchors)
    for i in sorted(range(len(anchors)), key=lambda i: (-anchors[i][1], anchors[i][0])):
        (x, y), (w, h) = anchors[i], sizes[i]
        dx = gap if x + gap + w <= right else -gap - w
        for step in range(4 * len(anchors) + 1):  # enough places for every other box to block two
            dy = gap + (step + 1) // 2 * (h + 1) * (1 if step % 2 else -1)
            box = (x + dx, y + dy, x + dx + w, y + dy + h)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                break
        placed.append(box)
        out[i] = (dx, dy)
    return out


def rule_curves(rows, key: str) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """The settings of each relaxed rule with one drafter at one K, as points sorted along ``key``:
    ``{("threshold", "K=8"): [(x, y), ...], ("pivot", "/hybrid K=8"): ...}``, only rules with two or more settings.
    The plot joins them so each rule reads as a curve on the accuracy/speed plane; target, draft, exact and the
    hf-* baselines are single points."""
    curves: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in rows:
        x, y = r[key], r["accuracy"]
        rule, k = _rule_and_k(r["policy"])
        if rule in ("target", "draft", "exact") or rule in HF_POLICIES or _missing(x):
            continue
        curves.setdefault((rule, k), []).append((x, y))
    return {rule_k: sorted(points) for rule_k, points in curves.items() if len(points) > 1}


def plot_axes(rows) -> list[tuple[str, str]]:
    """The (row key, axis label) of each panel of the frontier plot: accuracy against tokens/s and against tokens
    per target forward, leaving out tokens/s when no row has it (rows timed on machines of different speeds),
    so that no panel is drawn empty."""
    axes = [("tokens_per_s", "tokens/s"), ("mean_accepted_length", "tokens per target forward")]
    return [(key, label) for key, label in axes if any(not _missing(r[key]) for r in rows)] or axes[1:]


def interval_bounds(rows) -> dict[str, tuple[float, float]]:
    """{policy: (low, high)}: where each row's paired 95% interval of its accuracy difference from the reference
    (``summary_rows``' ``reference``, the row of that policy) lands on the accuracy axis, that is the reference's
    accuracy plus the interval's ends; the reference row itself and rows without an interval are left out."""
    accuracy = {r["policy"]: r["accuracy"] for r in rows}
    bounds = {}
    for r in rows:
        base = accuracy.get(r.get("reference", "target"), math.nan)
        low, high = r.get("accuracy_vs_target_low", math.nan), r.get("accuracy_vs_target_high", math.nan)
        if r["policy"] != r.get("reference", "target") and not math.isnan(base) and not math.isnan(low):
            bounds[r["policy"]] = (base + low, base + high)
    return bounds


def _plot(rows, path: Path, title: str) -> Path:
    """Accuracy against each of ``plot_axes``, every policy one point (its paired interval as an error bar,
    ``interval_bounds``); target and exact (with any drafter) marked, the settings of one rule in one colour and
    joined by a line (one line per drafter and K)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PadError("--plot needs matplotlib (pip install matplotlib)") from None
    bounds = interval_bounds(rows)
    reference = next((r.get("reference", "target") for r in rows), "target")
    colours: dict[str, str] = {}
    panels = plot_axes(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), sharey=True, squeeze=False)
    axes = list(axes[0])
    for ax, (key, label) in zip(axes, panels):
        for r in rows:
            x, y = r[key], r["accuracy"]
            if _missing(x):
                continue
            rule, _ = _rule_and_k(r["policy"])  # one colour a rule
            style = {"target": dict(marker="s", s=70, c="black"), "exact": dict(marker="D", s=60, c="tab:red")}.get(
                rule, dict(marker="o", s=35, c=colours.setdefault(rule, PALETTE[len(colours) % len(PALETTE)])))
            ax.scatter(x, y, zorder=3, **style)
            if r["policy"] in bounds:
                low, high = bounds[r["policy"]]
                # an interval ending at the point itself (no problem went the other way) can land 1 ulp past
                # it in float, and matplotlib refuses negative error lengths
                ax.errorbar(x, y, yerr=[[max(0.0, y - low)], [max(0.0, high - y)]],
                            fmt="none", ecolor="grey", alpha=0.5, zorder=2)
        for (rule, _), points in rule_curves(rows, key).items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, c=colours[rule], lw=0.8, alpha=0.6, zorder=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"accuracy (bar: paired 95% interval vs {reference})")
    fig.suptitle(textwrap.fill(title.splitlines()[0], 85 * len(panels)), fontsize=8)
    fig.tight_layout()
    fig.canvas.draw()  # the final layout and limits: where each point lands, in points
    for ax, (key, _) in zip(axes, panels):
        labels = point_labels(rows, key)
        anchors = [tuple(v * 72 / fig.dpi for v in ax.transData.transform((x, y))) for x, y, _ in labels]
        sizes = [(0.55 * 7 * len(text), 7 * 1.15) for _, _, text in labels]  # about, at fontsize 7
        right = ax.get_window_extent().x1 * 72 / fig.dpi
        for (x, y, text), (dx, dy) in zip(labels, label_offsets(anchors, sizes, right)):
            ax.annotate(text, (x, y), fontsize=7, xytext=(dx, dy), textcoords="offset points",
                        arrowprops=dict(arrowstyle="-", lw=0.4, color="grey") if dy != 3.0 else None)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def header(task: str, n: int, k: int, max_new_tokens: int, target_name: str, draft_name: str, dtype: str,
           command: str, *, classifier: str | None = None, batch_size: int = 1, draft_stop: float | None = None,
           sampling: str = "greedy") -> str:
    clf = f"; classifier {classifier}" if classifier else ""
    batch = (f"; batches of {batch_size} problems (hf-assisted one at a time: transformers refuses batches)"
             if batch_size > 1 else "")
    drafts = f"K={k}" if draft_stop is None else f"K<={k} (drafting stops below draft probability {draft_stop:g})"
    drafts += " unless a policy gives its own (policy:K)"
    return (f"{task}, {n} problems, {drafts}, max {max_new_tokens} new tokens, {sampling}, {dtype}; "
            f"target {target_name}, draft {draft_name}{clf}{batch}\n\nCommand: `{command}`\n\nMachine: {machine_line()}")
