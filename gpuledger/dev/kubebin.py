"""The pinned binaries of the local real cluster, built from the Go module proxy and cached.

- ``kube``: one multi-call binary (kube-apiserver, kube-controller-manager, kube-scheduler)
  built from the wrapper module deploy/local/kube (go.mod pins k8s.io/kubernetes and its
  staging modules). Cached under ``<cache>/kube-<version>-<hash of go.mod, go.sum, main.go>``,
  so it is rebuilt only when the pin (or the wrapper) changes.
- ``kwok`` and ``kueue``: ``go install <module>/cmd/<name>@<version>`` with GOBIN in
  ``<cache>/<name>-<version>``.
- ``kustomize``: the kustomize CLI (renders deploy/k8s in the tests), built from the wrapper
  module deploy/local/kustomize (go.mod's ``tool`` directive names the upstream main package;
  go.sum pins every dependency). Cached under ``<cache>/kustomize-<version>-<hash of go.mod,
  go.sum>``.
- ``module_dir``: where the Go module cache holds a module's files (Kueue's CRDs and webhook
  manifests are read from there, never copied into the repo).

Builds run under ``nice -n 10`` and hold a lock file, so a background build started by
``.ci/run`` and a test fixture that needs the binary wait for each other instead of building
twice. ``python3 -m gpuledger.dev.kubebin CACHE_DIR`` builds (or finds) all four and prints their
paths; this module uses the standard library only, so CI runs it before the virtualenv exists.
Limits: needs ``go`` (1.26+, for kustomize v5.8.2) on PATH and the Go module proxy reachable on the first build; the
first build of ``kube`` takes minutes (docs/real-cluster.md has the measured time).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBE_MODULE = REPO_ROOT / "deploy" / "local" / "kube"
KUBE_VERSION = "v1.34.4"
KUSTOMIZE_MODULE = REPO_ROOT / "deploy" / "local" / "kustomize"
#: The upstream main package of the kustomize CLI and its release (the pin in its go.mod).
KUSTOMIZE = ("sigs.k8s.io/kustomize/kustomize/v5", "v5.8.2")
KWOK = ("sigs.k8s.io/kwok", "v0.8.0")
KUEUE = ("sigs.k8s.io/kueue", "v0.17.0")
# Without these the components report v0.0.0-master (KWOK and Kueue read the server version).
_KUBE_LDFLAGS = ("-s -w -X k8s.io/component-base/version.gitVersion={v} -X k8s.io/component-base/version.gitMajor={major}"
                 " -X k8s.io/component-base/version.gitMinor={minor}")


class BuildError(RuntimeError):
    """A pinned binary could not be built (no Go, no proxy, a compile error)."""


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError("go is not on PATH; the local real cluster builds its Kubernetes, KWOK and Kueue binaries "
                         "from the Go module proxy once (Go 1.24+; see docs/real-cluster.md)")
    return go


def _run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    started = time.monotonic()
    proc = subprocess.run(["nice", "-n", "10", *cmd], cwd=cwd, env={**os.environ, "GOFLAGS": "-buildvcs=false", **(env or {})},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    log.info("%s took %.0fs", " ".join(cmd[:3]), time.monotonic() - started)
    return proc.stdout


@contextmanager
def _locked(cache_dir: Path, name: str) -> Iterator[None]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pin(version: str, module: Path, files: tuple[str, ...]) -> str:
    """A wrapper module's cache key: the release plus a hash of the module's files."""
    digest = hashlib.sha256()
    for name in files:
        digest.update((module / name).read_bytes())
    return f"{version}-{digest.hexdigest()[:12]}"


def kube_pin() -> str:
    """The cache key of the ``kube`` binary: the release plus a hash of the wrapper module."""
    return _pin(KUBE_VERSION, KUBE_MODULE, ("go.mod", "go.sum", "main.go"))


def kustomize_pin() -> str:
    """The cache key of the ``kustomize`` binary: the release plus a hash of its wrapper module."""
    return _pin(KUSTOMIZE[1], KUSTOMIZE_MODULE, ("go.mod", "go.sum"))


def _build_wrapper(cache_dir: Path, name: str, pin: str, module: Path, package: str, ldflags: str, what: str) -> Path:
    """``go build <package>`` inside the wrapper ``module`` into ``<cache>/<name>-<pin>/<name>``, once per pin."""
    cache_dir = Path(cache_dir)
    binary = cache_dir / f"{name}-{pin}" / name
    if binary.exists():
        return binary
    with _locked(cache_dir, f"{name}-build"):
        if binary.exists():  # built by whoever held the lock
            return binary
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_name(f"{name}.partial")
        log.info("building %s into %s (first time: minutes)", what, binary)
        _run([_go(), "build", "-trimpath", "-ldflags", ldflags, "-o", str(tmp), package], cwd=module)
        tmp.replace(binary)
    return binary


def ensure_kube(cache_dir: Path) -> Path:
    """The multi-call control-plane binary, built once per pin."""
    major, minor = KUBE_VERSION.lstrip("v").split(".")[:2]
    return _build_wrapper(cache_dir, "kube", kube_pin(), KUBE_MODULE, ".",
                          _KUBE_LDFLAGS.format(v=KUBE_VERSION, major=major, minor=minor),
                          f"kube-apiserver/controller-manager/scheduler {KUBE_VERSION}")


def ensure_kustomize(cache_dir: Path) -> Path:
    """The kustomize CLI of the pin in deploy/local/kustomize/go.mod, built once per pin."""
    return _build_wrapper(cache_dir, "kustomize", kustomize_pin(), KUSTOMIZE_MODULE, KUSTOMIZE[0], "-s -w", f"kustomize {KUSTOMIZE[1]}")


def ensure_go_tool(module: str, version: str, cache_dir: Path) -> Path:
    """``go install <module>/cmd/<name>@<version>`` into the cache, once."""
    cache_dir = Path(cache_dir)
    name = module.rsplit("/", 1)[1]
    binary = cache_dir / f"{name}-{version}" / name
    if binary.exists():
        return binary
    with _locked(cache_dir, f"{name}-build"):
        if binary.exists():
            return binary
        gobin = binary.parent / "partial"
        shutil.rmtree(gobin, ignore_errors=True)
        gobin.mkdir(parents=True)
        log.info("building %s %s into %s", name, version, binary)
        _run([_go(), "install", "-trimpath", "-ldflags", "-s -w", f"{module}/cmd/{name}@{version}"], env={"GOBIN": str(gobin)})
        (gobin / name).replace(binary)
        gobin.rmdir()
    return binary


def module_dir(module: str, version: str) -> Path:
    """The module's directory in the Go module cache (downloaded if it is not there)."""
    # From "/": outside any module, so no go.mod is consulted or touched.
    out = _run([_go(), "mod", "download", "-json", f"{module}@{version}"], cwd=Path("/"))
    return Path(json.loads(out)["Dir"])


def ensure_all(cache_dir: Path) -> dict[str, Path]:
    return {"kube": ensure_kube(cache_dir), "kwok": ensure_go_tool(*KWOK, cache_dir), "kueue": ensure_go_tool(*KUEUE, cache_dir),
            "kustomize": ensure_kustomize(cache_dir)}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if len(sys.argv) != 2:
        sys.exit("usage: python3 -m gpuledger.dev.kubebin CACHE_DIR")
    try:
        for component, path in ensure_all(Path(sys.argv[1])).items():
            print(component, path)
    except BuildError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
