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

from conftest import healthy, openai_server, post, post_status
from test_vllm_plugin import K, pad_config, pad_tokens

POLICY = "pivot@0.5"
# The load: ROUNDS rounds of REQUESTS requests from CLIENTS concurrent clients.
ROUNDS, REQUESTS, CLIENTS, CANCELLED, BAD = 3, 64, 16, 8, 4
REQUEST_POLICIES = [None, "pivot@0.5", "threshold@0.05", "exact", "typical@0.3,0.3", "fly@0.3,2"]
BAD_SETTINGS = [({"pad_policy": "banana"}, 0.0), ({"pad_policy": "fly@0.3,2"}, 0.8), ({"pad_floor": 0.5}, 0.0),
                ({"pad_exact_prefix": -1}, 0.0)]


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


def load_requests(model: str) -> list[dict]:
    """The round's requests (the same each round): ``kind`` good, cancelled or bad, and the request body."""
    rng = random.Random(0)
    kinds = ["bad"] * BAD + ["cancelled"] * CANCELLED + ["good"] * (REQUESTS - BAD - CANCELLED)
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        sampled = i % 2 == 1
        policy = REQUEST_POLICIES[i % len(REQUEST_POLICIES)]
        if sampled and policy and policy.startswith("fly"):
            policy = "threshold@0.05"  # fly serves greedy requests only
        body = {"model": model, "prompt": [rng.randrange(2, 256) for _ in range(rng.randrange(1, 24))],
                "max_tokens": rng.randrange(8, 32), "temperature": 0.8 if sampled else 0.0, "ignore_eos": True,
                "stream": i % 3 == 0, **({"seed": 1000 + i} if sampled else {}),
                **({"vllm_xargs": {"pad_policy": policy}} if policy else {})}
        if kind == "cancelled":
            body.update(stream=True, max_tokens=400)
        elif kind == "bad":
            xargs, temperature = BAD_SETTINGS[sum(k == "bad" for k in kinds[:i])]
            body.update(vllm_xargs=xargs, temperature=temperature)
        out.append({"kind": kind, "body": body})
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
    url, process, _ = server
    requests = load_requests(tiny["target"])
    alone = {i: send(url, r["body"]) for i, r in enumerate(requests)
             if r["kind"] == "good" and r["body"]["temperature"] == 0}
    assert all(status == 200 for status, _ in alone.values())
    first, memory, seconds = None, [], []
    for _ in range(ROUNDS):
        start = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(send, url, r["body"], 3 if r["kind"] == "cancelled" else None) for r in requests]
            results = [f.result(timeout=300) for f in futures]
        seconds.append(time.monotonic() - start)
        for i, (r, (status, text)) in enumerate(zip(requests, results)):
            if r["kind"] == "bad":
                assert status == 400, (r["body"], status, text)
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
    with capsys.disabled():
        print(f"\nload: {ROUNDS} rounds of {REQUESTS} requests from {CLIENTS} clients ({len(alone)} greedy and "
              f"{REQUESTS - BAD - CANCELLED - len(alone)} seeded sampled good ones, {CANCELLED} cancelled "
              f"mid-stream, {BAD} bad); rounds took {', '.join(f'{s:.1f}' for s in seconds)} s; resident memory "
              f"after each round {', '.join(f'{m:.0f}' for m in memory)} MiB")
    assert abs(memory[-1] - memory[0]) <= 0.05 * memory[0], memory
