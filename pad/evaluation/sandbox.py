"""Run untrusted Python (model-written code) so that it cannot reach the network nor outlive its run.

Each run gets, where this system allows it (``isolation()`` says which layers apply; a missing one is
logged once, and ``PAD_SANDBOX=strict`` refuses to run without the namespaces instead):

- **network**: a new network namespace, whose only interface is a loopback that is down: no connection
  leaves it, not to other hosts and not to servers on this machine's loopback. As root it is made
  directly; otherwise inside a new user namespace (unprivileged user namespaces).
- **processes**: a new PID namespace in which the program runs as process 1; when it ends, the kernel
  ends every process it started, also one that left its session with ``setsid``. The number of processes
  is capped by a pids cgroup where one can be made (as root, which ``RLIMIT_NPROC`` does not bind), else
  by ``RLIMIT_NPROC`` set just above the user's current count.
- **limits, always**: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE`` (also caps the output, which goes to
  a file), ``RLIMIT_NPROC``, no core dumps; a fresh temporary folder as working directory, ``HOME`` and
  ``TMPDIR``; the whole process group (and cgroup) killed after every run, also one that exited normally.

Without namespaces (no privileges and no user namespaces) the limits and the process group kill still
apply, but the program can reach the network and a process that calls ``setsid`` survives the run.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import PadError

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000

# The first process of a run: joins the cgroup, enters the namespaces, sets the limits, then forks the
# program as process 1 of the new PID namespace (it dies with this runner) and exits with its status.
_RUNNER = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if cfg["cgroup"]:
    with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
uid, gid = os.getuid(), os.getgid()
if cfg["unshare"] and libc.unshare(cfg["unshare"]) != 0:
    sys.stderr.write("sandbox: unshare failed: " + os.strerror(ctypes.get_errno()) + "\n")
    os._exit(125)
if cfg["unshare"] & 0x10000000:  # a user namespace: map our own ids only
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
for name, value in cfg["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
pid = os.fork()
if pid == 0:
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killing the runner kills the program
    os.execv(sys.executable, [sys.executable, "-I", cfg["script"]])
status = os.waitpid(pid, 0)[1]
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""
_PROBE_OK = 0
_REFUSED = 125  # the runner's exit code when unshare failed


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int | None = None  # None: the wall-clock timeout, rounded up, plus one second
    memory: int = 4 << 30  # RLIMIT_AS, bytes
    file_size: int = 16 << 20  # RLIMIT_FSIZE, bytes: any file written, the output included
    processes: int = 64  # processes and threads the program may add
    output: int = 64 << 10  # bytes of output kept in the result


@dataclass
class RunResult:
    returncode: int | None  # None when the run was killed at its timeout
    output: str  # stdout and stderr interleaved, at most Limits.output bytes (the start)
    timed_out: bool
    seconds: float


@dataclass(frozen=True)
class Isolation:
    unshare: int  # CLONE_* flags every run uses (0: no namespaces)
    cgroup: Path | None  # the pids cgroup folder runs are made under, or None (RLIMIT_NPROC only)

    @property
    def network(self) -> bool:
        return bool(self.unshare & CLONE_NEWNET)

    def describe(self) -> str:
        net = "own network namespace" if self.network else "NO network isolation"
        pids = ("own PID namespace" if self.unshare & CLONE_NEWPID else "no PID namespace (a setsid child survives)")
        cap = "pids cgroup" if self.cgroup else "RLIMIT_NPROC"
        return f"{net}, {pids}, process cap by {cap}, resource limits"


def _log(message: str) -> None:
    print(f"[pad] {message}", file=sys.stderr, flush=True)


def _pids_cgroup_base() -> Path | None:
    """This process's folder in a pids cgroup hierarchy that we may create children in, or None."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        _, point, kind, options = line.split()[:4]
        if kind == "cgroup" and "pids" in options.split(","):  # v1: its own hierarchy
            path = next((entry.split(":", 2)[2] for entry in own if "pids" in entry.split(":")[1].split(",")), None)
        elif kind == "cgroup2":
            path = next((entry.split(":", 2)[2] for entry in own if entry.startswith("0::")), None)
        else:
            continue
        if path is None:
            continue
        base = Path(point) / path.lstrip("/")
        if kind == "cgroup2":
            try:
                if "pids" not in (base / "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        if os.access(base, os.W_OK):
            return base
    return None


def _make_cgroup(base: Path, processes: int) -> Path | None:
    folder = base / f"pad-sandbox-{os.getpid()}-{time.monotonic_ns()}"
    try:
        folder.mkdir()
        (folder / "pids.max").write_text(str(processes))
        return folder
    except OSError:
        _remove_cgroup(folder)
        return None


def _remove_cgroup(folder: Path) -> None:
    """Kill every process in the cgroup (until none is left), then remove it."""
    for _ in range(200):
        try:
            pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
        except OSError:
            break
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    try:
        folder.rmdir()
    except OSError:
        pass


def _user_processes() -> int:
    uid, count = os.getuid(), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Which layers runs get here (probed once by starting a trivial program; the result is logged)."""
    base = _pids_cgroup_base()
    cgroup = None
    if base is not None and (probe := _make_cgroup(base, 8)) is not None:
        _remove_cgroup(probe)
        cgroup = base
    found = Isolation(0, cgroup)
    for flags in (CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID):
        if _run(Isolation(flags, None), "pass", 10.0, Limits()).returncode == _PROBE_OK:
            found = Isolation(flags, cgroup)
            break
    if not found.network:
        _log(f"sandbox: cannot create namespaces here (no privileges, no user namespaces): {found.describe()}; "
             "set PAD_SANDBOX=strict to refuse to run generated code like this")
    return found


def run(program: str, *, timeout: float = 10.0, limits: Limits = Limits()) -> RunResult:
    """Run the Python source ``program`` isolated (see the module docstring); waits at most ``timeout``
    seconds of wall-clock time, then kills it. Raises RuntimeError under ``PAD_SANDBOX=strict`` when the
    namespaces cannot be made here."""
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    iso = isolation()
    if os.environ.get("PAD_SANDBOX", "").lower() == "strict" and not (iso.network and iso.unshare & CLONE_NEWPID):
        raise PadError(f"PAD_SANDBOX=strict: refusing to run generated code without namespaces "
                       f"(here: {iso.describe()})")
    return _run(iso, program, timeout, limits)


def _run(iso: Isolation, program: str, timeout: float, limits: Limits) -> RunResult:
    cpu = limits.cpu_seconds if limits.cpu_seconds is not None else math.ceil(timeout) + 1
    # RLIMIT_NPROC counts all of the user's processes; it never binds root, whom the pids cgroup caps.
    nproc = limits.processes + (_user_processes() if os.getuid() != 0 else 0)
    cgroup = _make_cgroup(iso.cgroup, limits.processes) if iso.cgroup is not None else None
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pad-sandbox-") as tmp:
        script, out_path = Path(tmp) / "main.py", Path(tmp) / "output"
        script.write_text(program)
        cfg = {"cgroup": str(cgroup) if cgroup else None, "unshare": iso.unshare, "script": str(script),
               "limits": {"RLIMIT_CPU": cpu, "RLIMIT_AS": limits.memory, "RLIMIT_FSIZE": limits.file_size,
                          "RLIMIT_NPROC": nproc, "RLIMIT_CORE": 0}}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "HOME": tmp, "TMPDIR": tmp,
               "LANG": "C.UTF-8"}
        timed_out, code = False, None
        with open(out_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER, json.dumps(cfg)], cwd=tmp, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
                if cgroup is not None:
                    _remove_cgroup(cgroup)
        with open(out_path, "rb") as f:
            output = f.read(limits.output).decode(errors="replace")
    return RunResult(code, output, timed_out, time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the runner, its program and whatever stayed in the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
