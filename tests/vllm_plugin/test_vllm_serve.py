"""vLLM's OpenAI-compatible server with pad's configuration serves PAD (loopback only): one completion as
``pad.generate`` makes it, a request's own policy, bad settings refused alone, and a load of concurrent
clients with mixed policies, streaming, cancellations and bad requests."""
import http.client
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import psutil
import pytest

from bad_settings import BAD_SETTINGS, refused_by_vllm_itself
from conftest import healthy, openai_server, post, post_status
from test_vllm_plugin import K, pad_config, pad_tokens

POLICY = "pivot@0.5"
# The load: ROUNDS rounds of REQUESTS requests from CLIENTS concurrent clients, and every bad setting of
# tests/bad_settings.py beside them in each round (streamed in one round, unstreamed in the next).
ROUNDS, REQUESTS, CLIENTS, CANCELLED = 3, 64, 16, 8
REQUEST_POLICIES = [None, "pivot@0.5", "threshold@0.05", "exact", "typical@0.3,0.3", "fly@0.3,2"]


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    """A pivot engine with the right draft; yields (completions URL, the server's process, its log)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    speculative = {"method": "draft_model", "model": tiny["right"], "num_speculative_tokens": K}
    with openai_server(tiny["target"], speculative, pad_config(POLICY, tiny), log) as (base, process):
        yield f"{base}/v1/completions", process, log


def test_serve_completion_is_pads(server, tiny):
    url, _, log = server
    prompt, max_tokens = [5, 6, 7], 12
    body = {"model": tiny["target"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    reply = post(url, body)
    assert reply["choices"][0]["token_ids"] == pad_tokens(tiny, "right", POLICY, [prompt], max_tokens)[0]
    assert reply["usage"]["completion_tokens"] == max_tokens
    assert f"pad: acceptance policy {POLICY}" in log.read_text()
    # A request's own policy, through the OpenAI API's vllm_xargs (flat keys: it takes no objects).
    own = post(url, {**body, "vllm_xargs": {"pad_policy": "threshold@0.05"}})
    assert own["choices"][0]["token_ids"] == pad_tokens(tiny, "right", "threshold@0.05", [prompt], max_tokens)[0]
    # Bad settings: HTTP 400 naming the problem, and the server goes on.
    for xargs, temperature, message in [({"pad_policy": "banana"}, 0, "unknown policy"),
                                        ({"pad_policy": "fly@0.3,2"}, 0.8, "greedy requests only"),
                                        ({"pad_floor": 0.5}, 0, "unknown pad request setting")]:
        status, text = post_status(url, {**body, "temperature": temperature, "vllm_xargs": xargs})
        assert status == 400 and message in text, (xargs, status, text)
    assert post(url, body)["choices"][0]["token_ids"] == reply["choices"][0]["token_ids"]


def load_requests(model: str, round_: int) -> list[dict]:
    """A round's requests: ``kind`` good, cancelled or bad, the request body and, for a bad one, the key its
    refusal must name. Good and cancelled ones are the same each round. Greedy and sampled requests alternate
    and the policies cycle over pairs of them, so greedy fly requests run beside sampled ones in the same
    steps (what once stopped the engine)."""
    rng = random.Random(0)
    kinds = ["cancelled"] * CANCELLED + ["good"] * (REQUESTS - CANCELLED)
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        sampled = i % 2 == 1
        policy = REQUEST_POLICIES[(i // 2) % len(REQUEST_POLICIES)]
        if sampled and policy and policy.startswith("fly"):
            policy = "threshold@0.05"  # fly serves greedy requests only
        body = {"model": model, "prompt": [rng.randrange(2, 256) for _ in range(rng.randrange(1, 24))],
                "max_tokens": rng.randrange(8, 32), "temperature": 0.8 if sampled else 0.0, "ignore_eos": True,
                "stream": i % 3 == 0, **({"seed": 1000 + i} if sampled else {}),
                **({"vllm_xargs": {"pad_policy": policy}} if policy else {})}
        if kind == "cancelled":
            body.update(stream=True, max_tokens=400)
        out.append({"kind": kind, "body": body})
    # vllm_xargs takes no booleans: JSON true arrives as 1, which pad cannot tell from 1 (a whole exact_prefix);
    # those cases are the fast tier's (tests/test_serving_config.py).
    bad = [(x, t, k) for _, x, t, k in BAD_SETTINGS if not any(isinstance(v, bool) for v in x.values())]
    for j, (xargs, temperature, key) in enumerate(bad):
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": temperature,
                "stream": (j + round_) % 2 == 0, "vllm_xargs": xargs}
        if refused_by_vllm_itself(xargs):
            key = "extra_args"
        elif any(v is None or isinstance(v, dict) for v in xargs.values()):  # vllm_xargs' own types: vLLM's 400
            key = "vllm_xargs." + next(k for k, v in xargs.items() if v is None or isinstance(v, dict))
        out.append({"kind": "bad", "body": body, "key": key})
    return out


def send(url: str, body: dict, cancel_after: int | None = None) -> tuple[int, str]:
    """(HTTP status, the completion's text, or the error's body). Streaming: the text of its chunks, or the
    code and message of its error event; ``cancel_after``: the connection is closed after that many chunks."""
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", parts.path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.read().decode()
        if not body.get("stream"):
            return 200, json.loads(response.read())["choices"][0]["text"]
        text, chunks = [], 0
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:  # a refusal after the stream began: vLLM's error event, with its HTTP code
                return event["error"]["code"], event["error"]["message"]
            text.append(event["choices"][0]["text"])
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return 499, "".join(text)  # cancelled by the client
        return 200, "".join(text)
    finally:
        conn.close()


def resident_mib(process) -> float:
    """Resident memory of the server and its children (vLLM's engine core), MiB."""
    procs = [psutil.Process(process.pid)]
    procs += procs[0].children(recursive=True)
    return sum(p.memory_info().rss for p in procs) / 2**20


def test_load_mixed_policies_streaming_cancellations(server, tiny, capsys):
    """Every good greedy request's text equals the same request served alone, every seeded sampled one its
    own run in every round, bad ones get 400s, the server answers after each round, and its resident memory
    after the last round is within 5% of after the first."""
    url, process, log = server
    alone = {i: send(url, r["body"]) for i, r in enumerate(load_requests(tiny["target"], 0))
             if r["kind"] == "good" and r["body"]["temperature"] == 0}
    assert all(status == 200 for status, _ in alone.values())
    assert any("fly" in str(load_requests(tiny["target"], 0)[i]["body"]) for i in alone), "greedy fly requests"
    first, memory, seconds = None, [], []
    for round_ in range(ROUNDS):
        requests = load_requests(tiny["target"], round_)
        start = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(send, url, r["body"], 3 if r["kind"] == "cancelled" else None) for r in requests]
            results = [f.result(timeout=300) for f in futures]
        seconds.append(time.monotonic() - start)
        for i, (r, (status, text)) in enumerate(zip(requests, results)):
            if r["kind"] == "bad":  # refused as it arrives, naming the key (pad's check, or vLLM's own types)
                assert 400 <= status < 500 and r["key"] in text.replace('\\"', '"'), (str(r["body"])[:300], status,
                                                                                     text[:2000])
            elif r["kind"] == "cancelled":
                assert status == 499 and text, (status, text)
            elif i in alone:
                assert (status, text) == alone[i], (r["body"], text, alone[i][1])
            else:
                assert status == 200 and (first is None or text == first[i][1]), (r["body"], text)
        first = first or results
        assert healthy(url.rsplit("/v1", 1)[0])
        assert send(url, requests[min(alone)]["body"]) == alone[min(alone)]
        memory.append(resident_mib(process))
    assert process.poll() is None
    text = log.read_text()
    assert "EngineDeadError" not in text and "deciding a step failed" not in text, text[-4000:]
    bad = sum(r["kind"] == "bad" for r in requests)
    with capsys.disabled():
        print(f"\nload: {ROUNDS} rounds of {REQUESTS} requests from {CLIENTS} clients ({len(alone)} greedy and "
              f"{REQUESTS - CANCELLED - len(alone)} seeded sampled good ones, {CANCELLED} cancelled "
              f"mid-stream) and {bad} bad ones; rounds took {', '.join(f'{s:.1f}' for s in seconds)} s; resident "
              f"memory after each round {', '.join(f'{m:.0f}' for m in memory)} MiB")
    assert abs(memory[-1] - memory[0]) <= 0.05 * memory[0], memory
