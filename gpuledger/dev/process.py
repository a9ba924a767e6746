"""Run a gpuledger service (`gpuledger worker`, ...) as a child process; find a free port for it.

Used by the demo, the exercises, the tests and the benchmark: the child gets its
configuration through GPULEDGER_* environment variables, logs to a file, and is stopped
with SIGTERM, then SIGKILL if it does not exit within the grace period. ``program``
runs something other than the CLI the same way (the benchmark's Faust baseline).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one whose parent has not reaped it
    yet: a grandchild, or an orphan its new parent has not reaped, still shows in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # the state follows "(comm)"
    except OSError:
        return False


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_handed_out: set[int] = set()

#: Ports handed out by this user's processes on this machine, one file each holding the pid that
#: took it. Per user: a directory one user created is not writable by another, whose worker then
#: failed to start (PermissionError) — the claims guard against one's own parallel processes (the
#: test runner's workers); another user's choice of the same port is still caught by the bind check.
PORTS_DIR = Path(tempfile.gettempdir()) / f"gpuledger-ports-{os.getuid()}"


def _reserve(port: int) -> bool:
    """Claim ``port`` for this process among every process that uses ``free_port`` here: the
    test runner's parallel workers each chose ports at random from the same range, and a
    port one had just checked free was bound by another's child first (a real cluster's
    controller manager: "bind: address already in use"), because the check and the child's
    bind are seconds apart. A claim lasts until the claiming process is gone."""
    PORTS_DIR.mkdir(parents=True, exist_ok=True)
    path = PORTS_DIR / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or 0)
            except (OSError, ValueError):
                owner = 0
            if owner == os.getpid():
                return True
            if owner and pid_running(owner):
                return False
            try:
                path.unlink()  # its owner is gone (or it was never written): claim it again
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as claim:
            claim.write(str(os.getpid()))
        return True
    return False


def bindable(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` now (a bind succeeds). With SO_REUSEADDR, as
    the servers we start bind (Kafka's JVM, aiohttp): a port whose last server's connections sit
    in TIME-WAIT is free for them, and without it `kafka down; kafka up` read the broker's last
    port as taken and moved it, stranding every client (exploratory review). A listening socket
    still makes the bind fail."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a child service to listen on).

    Chosen at random *below* the kernel's ephemeral range: a port the kernel picked with
    bind(0) is one it also hands to outgoing connections, and with a broker, a cluster and
    their clients connecting all the time one of them took it before the child bound it
    (Kueue: "bind: address already in use" on a port free_port had just returned). Below the
    range only another explicit binder can collide; a random pick over ~20,000 ports, checked
    by binding, never the same twice in a process and claimed among this machine's processes
    (``_reserve``), makes that a process that is not ours.
    """
    low = _ephemeral_range()[0]
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10_000, low)
        if port in _handed_out or not bindable(port):
            continue
        if not _reserve(port):
            continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free TCP port on 127.0.0.1 in 10000-{low - 1} after 200 tries")


class ServiceError(RuntimeError):
    """A child service failed to start or died."""


def with_parent_command(command: list[str]) -> list[str]:
    """``command`` run so that it gets SIGTERM when the thread that started it ends: Linux's
    parent-death signal, set by util-linux's ``setpriv --pdeathsig`` before it execs the
    command (the same process: its pid is the command's). Not through ``preexec_fn``, which is
    unsafe in a process with threads (librdkafka's, in a test run). Without ``setpriv`` (not
    Linux) the command runs as it is."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *command] if setpriv else command


class ServiceProcess:
    """A child service with its log in a file. ``with_parent``: it gets SIGTERM when the thread
    that started it ends, however that ends (``with_parent_command``) — a `gpuledger replay` killed
    with SIGKILL left its worker running for ever, retrying a store or a broker long gone."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path,
                 program: Sequence[str] = (sys.executable, "-m", "gpuledger.cli"), with_parent: bool = False) -> None:
        self.args = args
        self.program = list(program)
        self.env = {**os.environ, **env}
        self.log_path = Path(log_path)
        self.with_parent = with_parent
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [*self.program, *self.args]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(with_parent_command(command) if self.with_parent else command, env=self.env, stdout=logf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, for restart tests."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_for_worker(service: ServiceProcess, owner_file: Path, timeout: float = 90.0) -> str:
    """Wait until the worker's sink recorded the store's owner file and the worker's health
    page answers; return the health page's URL (queries: ``RemoteReader.from_owner``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.alive():
            raise ServiceError(f"worker exited with {service.proc.returncode}:\n{service.log_tail()}")
        try:
            url = json.loads(owner_file.read_text())["health"]
            with urllib.request.urlopen(f"{url}/gpuledger/health/", timeout=2) as resp:
                if resp.status == 200:
                    return url
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise ServiceError(f"worker not ready within {timeout:.0f}s:\n{service.log_tail()}")
