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
