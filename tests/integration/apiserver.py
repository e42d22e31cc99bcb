"""A real etcd and kube-apiserver on loopback, built by hack/testbin.sh, for integration tests."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from kubernetes import client as k8s

from tests.releases import kube_release

REPO = Path(__file__).resolve().parents[2]
TESTBIN = Path(os.environ.get("TESTBIN_DIR", REPO / ".cache" / "testbin"))
TESTBIN_SCRIPT = REPO / "hack" / "testbin.sh"

KUBE_RELEASE = kube_release()
# The release's own binaries (kube-apiserver, etcd, kubectl, kubelet, kube-scheduler, kube-controller-manager).
KUBE_BIN = TESTBIN / f"kube-{KUBE_RELEASE}"

# The Nodes the session fixture creates: the agent's own node, and another for RBAC tests.
NODE = "gpu-node-1"
OTHER_NODE = "other-node"

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


def ensure_testbin() -> None:
    """Builds the pinned binaries if they are missing or stale; a no-op taking a second otherwise."""
    env = {**os.environ, "TESTBIN_DIR": str(TESTBIN)}
    # Output goes to the terminal: a cold build takes minutes and should be seen to progress.
    result = subprocess.run(["bash", str(TESTBIN_SCRIPT)], env=env, stdout=sys.stderr, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{TESTBIN_SCRIPT} failed with exit code {result.returncode}")


def pinned_versions() -> dict[str, str]:
    """The versions hack/testbin/{kube,etcd}/<release>/go.mod pin, e.g.
    {"kube-apiserver": "v1.37.2", "etcd": "v3.7.4"}."""
    out = subprocess.run(
        ["bash", str(TESTBIN_SCRIPT), "--print-versions"], capture_output=True, text=True, check=True
    ).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Polls condition until it holds; raises TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# --- child processes ------------------------------------------------------------------------------

# Every process group the rig ever started, so that a session hook can prove none is left.
STARTED_GROUPS: list[int] = []

# The kernel sends a child its parent-death signal when the *thread* that forked it exits, so
# children are forked from this one long-lived thread: they then die with the test process even
# when it is killed with SIGKILL and no cleanup code runs.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rig-spawner")
_PDEATHSIG = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    def start() -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [*_PDEATHSIG, *argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: teardown kills the whole group
            )

    proc = _spawner.submit(start).result()
    STARTED_GROUPS.append(proc.pid)
    return proc


def _stop_group(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM to the process group, SIGKILL after `grace` seconds; reaps the leader."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; anything it left in its group goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_live: set[ApiServer] = set()
_safeguards_installed = False


def _stop_all() -> None:
    for rig in list(_live):
        rig.stop()


def _install_safeguards() -> None:
    """Stops every rig at interpreter exit and on SIGTERM/SIGHUP, which skip pytest's teardown."""
    global _safeguards_installed
    if _safeguards_installed:
        return
    _safeguards_installed = True
    atexit.register(_stop_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            _stop_all()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


# --- certificates ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


class Authority:
    """A throwaway certificate authority, made with the openssl CLI (P-256 keys: fast to make)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cert = self.dir / "ca.crt"
        self.key = self.dir / "ca.key"
        self._openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", self.key, "-out", self.cert, "-days", "7", "-subj", "/CN=gpu-node-agent-test-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )  # fmt: skip

    def _openssl(self, *args: str | Path) -> None:
        result = subprocess.run(["openssl", *map(str, args)], cwd=self.dir, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")

    def issue(self, name: str, subject: str, *, server: bool = False, sans: tuple[str, ...] = ()) -> KeyPair:
        """A leaf certificate: a serving one when `server`, a client one otherwise."""
        pair = KeyPair(self.dir / f"{name}.crt", self.dir / f"{name}.key")
        csr, ext = self.dir / f"{name}.csr", self.dir / f"{name}.ext"
        lines = [
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature",
            f"extendedKeyUsage={'serverAuth' if server else 'clientAuth'}",
        ]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        self._openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", pair.key, "-out", csr, "-subj", subject,
        )  # fmt: skip
        self._openssl(
            "x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key, "-set_serial",
            str(int.from_bytes(os.urandom(8), "big")), "-days", "7", "-extfile", ext, "-out", pair.cert,
        )  # fmt: skip
        return pair

    def signing_key(self, name: str) -> KeyPair:
        """A bare key pair (private key in `key`, public key in `cert`), for service-account tokens."""
        pair = KeyPair(self.dir / f"{name}.pub", self.dir / f"{name}.key")
        self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", pair.key)
        self._openssl("pkey", "-in", pair.key, "-pubout", "-out", pair.cert)
        return pair


# --- the rig ----------------------------------------------------------------------------------------


class ApiServer:
    """etcd and kube-apiserver on loopback ports in `workdir`; start() / restart() / stop()."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.etcd_url = f"http://127.0.0.1:{free_port()}"
        self._etcd_peer_url = f"http://127.0.0.1:{free_port()}"
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self._clients: list[k8s.ApiClient] = []

        pki = Authority(workdir / "pki")
        self._pki = pki
        self.ca_path = pki.cert
        self._serving = pki.issue(
            "apiserver", "/CN=kube-apiserver", server=True,
            sans=("IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost", "DNS:kubernetes",
                  "DNS:kubernetes.default", "DNS:kubernetes.default.svc"),
        )  # fmt: skip
        self.admin = pki.issue("admin", "/O=system:masters/CN=rig-admin")
        self._sa_key = pki.signing_key("service-account")
        self.kubeconfig_path = self._write_kubeconfig(
            "admin", {"client-certificate": str(self.admin.cert), "client-key": str(self.admin.key)}
        )

    def __repr__(self) -> str:
        return f"ApiServer({self.url})"

    # lifecycle

    def start(self) -> None:
        _install_safeguards()
        _live.add(self)
        try:
            self._start_etcd()
            self._start_apiserver()
        except BaseException:
            self.stop()
            raise

    def restart(self) -> None:
        """Stops kube-apiserver and starts it again on the same port; etcd (and so all objects) stays."""
        if self._apiserver is not None:
            _stop_group(self._apiserver)
            self._apiserver = None
        self._start_apiserver()

    def stop(self) -> None:
        """Stops everything this rig started; safe to call more than once."""
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()
        for proc in (self._apiserver, self._etcd):
            if proc is not None:
                _stop_group(proc)
        self._apiserver = self._etcd = None
        # etcd preallocates a 64 MB WAL; keep the logs and certificates, drop the data.
        shutil.rmtree(self.workdir / "etcd-data", ignore_errors=True)
        _live.discard(self)

    @property
    def process_groups(self) -> list[int]:
        return [p.pid for p in (self._etcd, self._apiserver) if p is not None]

    def _start_etcd(self) -> None:
        self._etcd = _spawn(
            [
                str(KUBE_BIN / "etcd"),
                "--name=rig",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={self._etcd_peer_url}",
                f"--initial-advertise-peer-urls={self._etcd_peer_url}",
                f"--initial-cluster=rig={self._etcd_peer_url}",
                "--log-level=warn",
                "--unsafe-no-fsync",  # test data: durability buys nothing, fsync costs seconds
            ],
            self.workdir / "etcd.log",
        )
        proc = self._etcd

        def healthy() -> bool:
            self._check_alive(proc, "etcd")
            try:
                with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as r:
                    return bool(json.load(r).get("health") == "true")
            except (urllib.error.URLError, OSError, ValueError):
                return False

        wait_until(healthy, 60, "etcd /health")

    def _start_apiserver(self) -> None:
        self._apiserver = _spawn(
            [
                str(KUBE_BIN / "kube-apiserver"),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--etcd-servers={self.etcd_url}",
                f"--tls-cert-file={self._serving.cert}",
                f"--tls-private-key-file={self._serving.key}",
                f"--client-ca-file={self.ca_path}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={self._sa_key.cert}",
                f"--service-account-signing-key-file={self._sa_key.key}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction,ValidatingAdmissionPolicy",
                # Nothing runs the kubernetes Service's endpoints here, and they may not be loopback.
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
            self.workdir / "kube-apiserver.log",
        )
        proc = self._apiserver
        context = ssl.create_default_context(cafile=str(self.ca_path))
        context.load_cert_chain(str(self.admin.cert), str(self.admin.key))

        def ready() -> bool:
            self._check_alive(proc, "kube-apiserver")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=5, context=context) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_until(ready, 120, "kube-apiserver /readyz", interval=0.25)
        # The bootstrap controller creates the default namespace just after the server turns ready.
        core = k8s.CoreV1Api(self.admin_client())
        wait_until(lambda: _exists(lambda: core.read_namespace("default")), 30, "namespace default")

    def _check_alive(self, proc: subprocess.Popen[bytes], name: str) -> None:
        if proc.poll() is not None:
            log = self.workdir / f"{name}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"{name} exited with code {proc.returncode}; last lines of {log}:\n{tail}")

    # identities

    def admin_client(self) -> k8s.ApiClient:
        """A client with the rig's system:masters certificate."""
        return self._client(cert_file=str(self.admin.cert), key_file=str(self.admin.key))

    def release(self) -> tuple[int, int]:
        """(major, minor) of the running kube-apiserver, as its /version says: what tests whose expectation
        depends on the release ask, rather than assume."""
        info = k8s.VersionApi(self.admin_client()).get_code()
        return int(info.major), int(str(info.minor).rstrip("+"))

    def behaves_as(self) -> tuple[int, int]:
        """(major, minor) of the release the running kube-apiserver behaves as: the release it emulates
        (`--emulated-version`; /version's emulationMajor and emulationMinor), else its own. What a test asks of a
        server started with a gate off that its release locked on (dra_rig.GatedApiServer)."""
        info = k8s.VersionApi(self.admin_client()).get_code()
        if info.emulation_major and info.emulation_minor:
            return int(info.emulation_major), int(str(info.emulation_minor).rstrip("+"))
        return int(info.major), int(str(info.minor).rstrip("+"))

    def node_client(self, node: str) -> k8s.ApiClient:
        """A client with the identity a kubelet on `node` has (system:node:<node>, group system:nodes)."""
        pair = self._pki.issue(f"node-{node}", f"/O=system:nodes/CN=system:node:{node}")
        return self._client(cert_file=str(pair.cert), key_file=str(pair.key))

    def service_account_token(self, name: str, namespace: str = "default", expiration_seconds: int = 3600) -> str:
        """A token for the ServiceAccount from the TokenRequest API; creates the account if needed."""
        core = k8s.CoreV1Api(self.admin_client())
        if not _exists(lambda: core.read_namespace(namespace)):
            core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=namespace)))
        if not _exists(lambda: core.read_namespaced_service_account(name, namespace)):
            core.create_namespaced_service_account(
                namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name=name))
            )
        request = k8s.AuthenticationV1TokenRequest(
            spec=k8s.V1TokenRequestSpec(audiences=[SERVICE_ACCOUNT_ISSUER], expiration_seconds=expiration_seconds)
        )
        status = core.create_namespaced_service_account_token(name, namespace, request).status
        if status is None or not status.token:
            raise RuntimeError(f"the TokenRequest for {namespace}/{name} returned no token")
        return str(status.token)

    def service_account_client(self, name: str, namespace: str = "default") -> k8s.ApiClient:
        token = self.service_account_token(name, namespace)
        return self._client(api_key={"BearerToken": token}, api_key_prefix={"BearerToken": "Bearer"})

    def service_account_kubeconfig(self, name: str, namespace: str = "default") -> Path:
        return self._write_kubeconfig(f"sa-{namespace}-{name}", {"token": self.service_account_token(name, namespace)})

    def _client(self, **config: Any) -> k8s.ApiClient:
        api = k8s.ApiClient(k8s.Configuration(host=self.url, ssl_ca_cert=str(self.ca_path), **config))
        self._clients.append(api)
        return api

    def _write_kubeconfig(self, user: str, credentials: dict[str, str]) -> Path:
        path = self.workdir / f"{user}.kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "rig", "cluster": {"server": self.url, "certificate-authority": str(self.ca_path)}}],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": "rig", "context": {"cluster": "rig", "user": user}}],
            "current-context": "rig",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    # objects

    def create_node(self, name: str) -> None:
        core = k8s.CoreV1Api(self.admin_client())
        core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))


def _exists(read: Callable[[], object]) -> bool:
    try:
        read()
    except k8s.ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


@contextlib.contextmanager
def running(workdir: Path, nodes: tuple[str, ...] = ()) -> Iterator[ApiServer]:
    """A started rig with `nodes` created; stopped on the way out, whatever happened."""
    rig = ApiServer(workdir)
    try:
        rig.start()
        for node in nodes:
            rig.create_node(node)
        yield rig
    finally:
        rig.stop()
