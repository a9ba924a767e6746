"""free_port hands out listenable ports the kernel will not give to an outgoing connection."""

import socket

from gpuledger.dev.process import _ephemeral_range, free_port


def test_free_ports_are_distinct_listenable_and_below_the_ephemeral_range():
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(10_000 <= port < low for port in ports), ports
    listeners = []
    try:
        for port in ports[:5]:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", port))
            sock.listen()
            listeners.append(sock)
        # An outgoing connection's local port comes from the ephemeral range, never one of ours.
        with socket.create_connection(("127.0.0.1", ports[0])) as client:
            assert client.getsockname()[1] >= low
    finally:
        for sock in listeners:
            sock.close()


def test_ports_claimed_by_another_live_process_are_not_handed_out_and_a_dead_ones_are(tmp_path, monkeypatch):
    """Parallel test workers pick from the same range: a port one of them handed out (its child
    may bind it seconds later) is never handed out by another while the first lives."""
    import os
    import subprocess
    import sys

    from gpuledger.dev import process

    monkeypatch.setattr(process, "PORTS_DIR", tmp_path)
    # Another live process claims every port but one, in a range narrowed to 12 ports.
    low = 10_000
    monkeypatch.setattr(process, "_ephemeral_range", lambda: (low + 12, 60999))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for port in range(low, low + 12):
            if port != low + 7:
                (tmp_path / str(port)).write_text(str(other.pid))
        monkeypatch.setattr(process, "_handed_out", set())
        assert process.free_port() == low + 7  # the only port nobody alive has claimed
        assert (tmp_path / str(low + 7)).read_text() == str(os.getpid())
        other.kill()
        other.wait()
        monkeypatch.setattr(process, "_handed_out", {low + 7})
        freed = process.free_port()  # its claimer is gone: its ports are free to claim again
        assert freed != low + 7 and (tmp_path / str(freed)).read_text() == str(os.getpid())
    finally:
        other.kill()
        other.wait()


def test_another_user_gets_ports_while_this_users_claims_exist(tmp_path):
    """Found by an exploratory review: the claims directory was one per machine, created by the
    first user (0755); a second user's worker then failed to start (PermissionError). Each user
    has their own now. Run as another user where this test can switch to one (root, setpriv)."""
    import os
    import shutil
    import subprocess
    import sys

    import pytest

    free_port()  # this user's claims directory exists now
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another user")
    home = tmp_path / "nobody"
    home.mkdir()
    os.chown(home, 65534, 65534)
    code = "from gpuledger.dev.process import free_port, PORTS_DIR; p = free_port(); print(p, (PORTS_DIR / str(p)).exists())"
    root = str(__import__("pathlib").Path(__file__).resolve().parents[3])
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                          env={**os.environ, "HOME": str(home), "PYTHONPATH": root}, capture_output=True, text=True, timeout=60, cwd=str(home))
    assert proc.returncode == 0, proc.stderr[-2000:]
    port, claimed = proc.stdout.split()
    assert int(port) >= 10_000 and claimed == "True", proc.stdout


def test_a_port_whose_last_server_left_connections_in_time_wait_is_bindable_one_listened_on_is_not():
    """`kafka down; kafka up` moved the broker to a new port when its last port's server-side
    connections sat in TIME-WAIT (the bind check did not set SO_REUSEADDR, as the broker does)."""
    from gpuledger.dev.process import bindable

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", free_port()))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    assert not bindable(port)  # listened on
    accepted.close()  # the server side closes first: its end of the connection goes to TIME-WAIT
    client.close()
    server.close()
    assert bindable(port)
