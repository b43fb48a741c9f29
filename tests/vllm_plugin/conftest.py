"""Tiny random models saved as folders vLLM can load (a WordLevel tokenizer), and a way to run engines."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from pad.decoding.hf import LayerCapture
from pad.models.classifier import PivotClassifier
from tiny import noisy_copy

VOCAB = 256
LAYERS = 4
HERE = Path(__file__).parent


def tiny_qwen2(seed: int):
    """A random Qwen2 (head dim 64, as vLLM's CPU attention takes) with peaked logits."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, eos_token_id=1,
                      bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # spread logits so that top tokens are neither certain nor uniform
    model.generation_config.eos_token_id = None
    return model


def save(model, folder: Path) -> str:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """{"target", "right" (a draft that mostly agrees), "wrong" (an unrelated draft), "classifier"}: folders,
    and the HuggingFace models themselves under "models"."""
    root = tmp_path_factory.mktemp("vllm-models")
    target = tiny_qwen2(0)
    right = noisy_copy(target, 0.01, 1)
    wrong = tiny_qwen2(7)
    clf = PivotClassifier(128, layer=-2, kind="linear", target_model="target", draft_model="right")
    torch.manual_seed(3)
    with torch.no_grad():  # random weights over features standardized as training would: pivot probs spread
        clf.linear.weight.normal_(0, 0.15)
        clf.linear.bias.zero_()
        capture = LayerCapture(target.model, clf.layer)
        capture.keep = 64
        probs = torch.softmax(target(torch.arange(2, 66)[None]).logits[0], -1)
        capture.remove()
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        x = torch.cat([capture.value[0], probs.max(-1).values[:, None], entropy[:, None]], -1)
        clf.input_mean.copy_(x.mean(0))
        clf.input_scale.copy_(x.std(0))
    clf.save(root / "classifier")
    return {"target": save(target, root / "target"), "right": save(right, root / "right"),
            "wrong": save(wrong, root / "wrong"), "classifier": str(root / "classifier"),
            "models": {"target": target, "right": right, "wrong": wrong}}


def engine_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # vLLM's own kernels, not the tests'
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def run_engines(spec: dict, tmp_path: Path, **env) -> list[dict]:
    """Run engine_runs.py on ``spec`` in a fresh process; returns one result per run."""
    spec_file, out_file = tmp_path / "spec.json", tmp_path / "out.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HERE / "engine_runs.py"), str(spec_file), str(out_file)],
                          env=engine_env(**env), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"engine run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out_file.read_text())


SERVER_STARTUP_S = 300


def post(url, body, timeout=120):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def post_status(url, body) -> tuple[int, str]:
    """(HTTP status, body text), errors included."""
    try:
        return 200, json.dumps(post(url, body))
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@contextlib.contextmanager
def openai_server(target: str, speculative: dict, pad: dict, log_path: Path, *args: str):
    """vLLM's OpenAI-compatible server on a free loopback port, in vLLM's default multiprocess mode; yields
    (base URL, the server's process). Started as ``python -m vllm.entrypoints.openai.api_server``, the same
    server and arguments as ``vllm serve``: the CPU build's ``vllm`` command stops at start because it looks up
    the version of a distribution named ``vllm``, and the CPU build's is named ``vllm-cpu``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--speculative-config", json.dumps(speculative), "--additional-config", json.dumps({"pad": pad}), *args]
    log = open(log_path, "w")
    # cwd: not the source tree, whose build metadata `python -m` would put first on the path.
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=log_path.parent,
                              env=engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_STARTUP_S
        while not healthy(base):
            assert server.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "the server did not start in time"
            time.sleep(1)
        yield base, server
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False
