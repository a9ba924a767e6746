"""The DCGM-shaped page and the kubelet doubles of ``gpuledger dev cluster up``, in a process of their own.

``up`` returns while the cluster keeps running, so what ``gpuledger.dev.peers`` and
``gpuledger.dev.kubelets`` serve in-process (the ``DcgmExporter`` page, one ``FakeKubelet`` socket
per KWOK node fed from the API server's pods, with dcgm-exporter's pod mapping) runs here:
``python -m gpuledger.dev.peerhost --state FILE --metrics-port P --control-port C --socket-dir D``.
Input: the cluster's state (``cluster.json``: server, ports, data dir with the admin token).
Output: ``/metrics`` on ``P``; the sockets ``D/<node>.sock``; on ``C`` a small control API for a
developer's drills — ``GET /v1/devices`` (node, index, device id, UUID, holder) and
``POST /v1/xid`` ``{"node": …, "index": …, "xid": 79}`` (or ``"device_id"``): the device's last XID
(0 clears it; non-zero also drops it from its kubelet's allocatable set).
Runs until SIGTERM/SIGINT. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gpuledger.dev.cluster import LocalCluster
from gpuledger.dev.kubelets import ClusterKubelets
from gpuledger.dev.peers import DcgmExporter, PeerError, node_devices


def _handler(exporter: DcgmExporter, kubelets: ClusterKubelets):
    class Control(BaseHTTPRequestHandler):
        def _answer(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/v1/devices":
                return self._answer(404, {"error": "GET /v1/devices or POST /v1/xid"})
            self._answer(200, [{"node": node, "index": i, "device_id": d.device_id, "uuid": d.uuid, "xid": d.xid,
                                "gpu_instance": d.gpu_instance, "holder": d.holder}
                               for node, devs in kubelets.devices.items() for i, d in enumerate(devs)])

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/xid":
                return self._answer(404, {"error": "POST /v1/xid"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                device_id = body.get("device_id") or kubelets.devices[body["node"]][int(body["index"])].device_id
                xid = int(body["xid"])
                dev = exporter.set_xid(device_id, xid)
            except (ValueError, KeyError, IndexError, TypeError, PeerError) as exc:
                return self._answer(400, {"error": f"expected {{node, index, xid}} or {{device_id, xid}} naming a device: {exc!r}"})
            if xid:
                kubelets.mark_unhealthy(device_id)
            self._answer(200, {"device_id": dev.device_id, "uuid": dev.uuid, "xid": dev.xid})

        def log_message(self, fmt: str, *args) -> None:  # one line per request on stderr is noise here
            pass

    return Control


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", type=Path, required=True, help="the cluster's cluster.json")
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--control-port", type=int, required=True)
    ap.add_argument("--socket-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    cluster = LocalCluster.attach(json.loads(args.state.read_text()))
    args.socket_dir.mkdir(parents=True, exist_ok=True)
    exporter = DcgmExporter([d for n in cluster.nodes for d in node_devices(n)], port=args.metrics_port).start()
    kubelets = ClusterKubelets(cluster, args.socket_dir, exporter).start()
    control = ThreadingHTTPServer(("127.0.0.1", args.control_port), _handler(exporter, kubelets))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=control.serve_forever, name="control", daemon=True).start()
    print(f"DCGM page {exporter.url}, control http://127.0.0.1:{args.control_port}/v1/xid, kubelet sockets in {args.socket_dir}",
          flush=True)
    stop.wait()
    control.shutdown()
    kubelets.stop()
    exporter.stop()


if __name__ == "__main__":
    main()
