"""Hostile completions against the HumanEval check: each one passes its tests unless the sandbox stops it.

The problem below is solved by ``return 1``; every completion returns 1 and then, at module level, does
something a check must not allow. Without isolation the check would pass (and the side effect happen).
"""
import os
import shutil
import socket
import threading
import time

import pytest

from pad.evaluation import sandbox, tasks

PROBLEM = tasks.Problem(id="test/0", question="def one():\n", reference="def check(fn):\n    assert fn() == 1\n",
                        entry_point="one")
SOLVED = "    return 1\n\n"


def check(code: str, timeout: float = 10.0) -> bool:
    return tasks.humaneval_correct(PROBLEM, SOLVED + code, timeout=timeout)


def test_a_plain_solution_passes_and_a_wrong_one_fails():
    assert check("")
    assert not tasks.humaneval_correct(PROBLEM, "    return 2\n")


class HttpServer:
    """A TCP server on this namespace's loopback that answers any request with HTTP 200 and counts them."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(1)
                try:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
                except OSError:
                    pass

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


@pytest.fixture
def server():
    s = HttpServer()
    yield s
    s.close()


def test_server_is_reachable_from_outside_the_sandbox(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as c:
        c.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert c.recv(100).startswith(b"HTTP/1.0 200")
    time.sleep(0.2)
    assert server.connections == 1


def test_raw_socket_cannot_reach_a_loopback_server(server):
    code = (f"import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\ns.settimeout(3)\n"
            f"s.connect(('127.0.0.1', {server.port}))\ns.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')\n")
    assert not check(code)
    time.sleep(0.2)
    assert server.connections == 0


def test_subprocess_curl_cannot_reach_a_loopback_server(server):
    url = f"http://127.0.0.1:{server.port}/"
    # curl where it is installed; a second Python otherwise (the same escape: a child process).
    cmd = (["curl", "-sf", "-m", "3", url] if shutil.which("curl")
           else ["python3", "-c", f"import urllib.request; urllib.request.urlopen({url!r}, timeout=3)"])
    assert not check(f"import subprocess\nsubprocess.run({cmd!r}, check=True, capture_output=True)\n")
    time.sleep(0.2)
    assert server.connections == 0


def test_fork_bomb_is_contained(tmp_path):
    count = tmp_path / "forks"
    # Count the forks that succeed (children sleep), then keep forking until the check's time runs out.
    code = f"""import os, time
n = 0
for _ in range(300):
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except OSError:
        break
    n += 1
open({str(count)!r}, "w").write(str(n))
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
"""
    start = time.monotonic()
    assert not check(code, timeout=3.0)
    assert time.monotonic() - start < 3.0 + 5.0
    assert int(count.read_text()) < sandbox.Limits().processes


def _gone(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # killed, waiting to be reaped by an init outside the sandbox


def test_setsid_child_does_not_survive_the_check(tmp_path):
    pidfile = tmp_path / "pid"
    code = f"""import os, time
if os.fork() == 0:
    os.setsid()
    open({str(pidfile)!r} + ".tmp", "w").write(os.readlink("/proc/self"))
    os.rename({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
    time.sleep(300)
    os._exit(0)
while not os.path.exists({str(pidfile)!r}):
    time.sleep(0.01)
"""
    assert check(code)  # the check itself passes and exits normally
    pid = int(pidfile.read_text())  # its id outside the sandbox (/proc/self of this machine's /proc)
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), f"process {pid} outlived the check"


def test_a_large_file_write_is_stopped(tmp_path):
    big = tmp_path / "big"
    code = f"""with open({str(big)!r}, "wb") as f:
    for _ in range(1024):
        f.write(b"\\0" * (1 << 20))
"""
    assert not check(code)
    assert big.stat().st_size <= sandbox.Limits().file_size


def test_endless_print_is_capped():
    start = time.monotonic()
    assert not check("while True:\n    print('x' * 1000)\n", timeout=20.0)
    assert time.monotonic() - start < 10.0  # stopped by the output cap, long before its time limit
    result = sandbox.run("print('start')\nwhile True:\n    print('x' * 1000)\n", timeout=20.0)
    assert result.returncode != 0 and not result.timed_out
    assert result.output.startswith("start\n") and len(result.output) <= sandbox.Limits().output


def test_timeout_kills_and_reports():
    result = sandbox.run("while True:\n    pass\n", timeout=1.0)
    assert result.timed_out and result.returncode is None and result.seconds < 5


def test_isolation_is_reported():
    iso = sandbox.isolation()
    text = iso.describe()
    assert ("own network namespace" in text) == iso.network
    if os.environ.get("PAD_REQUIRE_SANDBOX") == "1":  # CI machines can make namespaces and cgroups
        assert iso.network and iso.unshare & sandbox.CLONE_NEWPID


def test_strict_mode_refuses_without_namespaces(monkeypatch):
    monkeypatch.setenv("PAD_SANDBOX", "strict")
    monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation(0, None))
    with pytest.raises(RuntimeError, match="PAD_SANDBOX=strict"):
        sandbox.run("pass")


def test_bad_timeout():
    with pytest.raises(ValueError, match="timeout"):
        sandbox.run("pass", timeout=0)
