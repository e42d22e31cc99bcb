"""The agent's credentials for the API server, read as kubectl reads them: a kubeconfig's current context (a
token, a token file or a client certificate; a CA, or insecure-skip-tls-verify), or the pod's service account."""

from __future__ import annotations

import base64
import binascii
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.yamlfile import InputFileError, YamlProblem, clip, load_yaml, read_file_bytes, read_text_file, shown

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class CredentialsError(ValueError):
    """The kubeconfig or in-cluster credentials cannot be used; the message says which part and why."""


TOKEN_MAX_BYTES = 64 * 1024
"""A bearer token is a few kilobytes at most (a projected service-account token is about one)."""
TLS_MAX_BYTES = 1024 * 1024
"""The most read of a CA, client certificate or client key file: a cluster's CA or a certificate chain is a few
kilobytes, and even the system's whole CA bundle (about 150 certificates) is about 220 KB."""


@dataclass
class Credentials:
    server: str
    ssl: ssl.SSLContext
    token: str | None = None
    token_file: Path | None = None
    """Read before each request: projected service-account tokens are rotated by the kubelet."""

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            try:
                token = read_text_file(self.token_file, TOKEN_MAX_BYTES).strip()
            except InputFileError as err:
                raise CredentialsError(f"cannot read the token {self.token_file}: {err.reason}") from None
        return {"Authorization": f"Bearer {token}"} if token else {}


def _material(entry: Mapping[str, Any], key: str, base: Path, where: str) -> tuple[str | None, bytes | None]:
    """A kubeconfig file reference (`key`, relative to the kubeconfig) or inline data (`key-data`, base64);
    CredentialsError naming `where` and the key when it is neither text nor base64."""
    for name in (f"{key}-data", key):
        if entry.get(name) and not isinstance(entry[name], str):
            raise CredentialsError(f"{where}: {name} must be a string, got {shown(entry[name])}")
    if entry.get(f"{key}-data"):
        try:
            return None, base64.b64decode(entry[f"{key}-data"], validate=True)
        except (binascii.Error, ValueError):
            raise CredentialsError(f"{where}: {key}-data is not base64") from None
    if entry.get(key):
        path = Path(entry[key])
        return str(path if path.is_absolute() else base / path), None
    return None, None


def _reason(err: Exception) -> str:
    """What went wrong loading TLS material, in a few words: the OS's or OpenSSL's reason, not Python's repr."""
    if isinstance(err, ssl.SSLError):
        return "not PEM that OpenSSL accepts" + (f" ({err.reason})" if err.reason else "")
    if isinstance(err, InputFileError):  # the file is named beside the reason already
        return "no such file or directory" if err.reason == "no such file" else err.reason
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return clip(" ".join(str(err).split()))


def _private_copy(path: str, directory: str, name: str) -> str:
    """A copy of the TLS file `path` in the private `directory`, read as every input file is (at most
    TLS_MAX_BYTES; a FIFO or a device refused, never waited on): the ssl module loads certificates from files
    only, and OpenSSL would read `path` itself without either bound."""
    copy = os.path.join(directory, name)
    Path(copy).write_bytes(read_file_bytes(Path(path), TLS_MAX_BYTES))
    return copy


def _ssl_context(ca_file: str | None, ca_data: bytes | None, insecure: bool) -> ssl.SSLContext:
    """The TLS context for the API server: its CA, or (insecure-skip-tls-verify) no check of the server at all;
    either way a context, so that a client certificate can still be presented."""
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if ca_file is None:
        return ssl.create_default_context(cadata=ca_data.decode() if ca_data else None)
    with tempfile.TemporaryDirectory(prefix="gpu-agent-ca-") as tmp:
        return ssl.create_default_context(cafile=_private_copy(ca_file, tmp, "ca.pem"),
                                          cadata=ca_data.decode() if ca_data else None)


def _load_client_cert(context: ssl.SSLContext, cert: tuple[str | None, bytes | None],
                      key: tuple[str | None, bytes | None]) -> None:
    (cert_file, cert_data), (key_file, key_data) = cert, key
    if not (cert_file or cert_data):
        return
    with tempfile.TemporaryDirectory(prefix="gpu-agent-cert-") as tmp:
        # The ssl module loads certificates from files only: inline data, and a copy of each file read with the
        # bounds of every input file, are written to a private temp dir and loaded from there.
        if cert_data is not None:
            cert_file = os.path.join(tmp, "cert.pem")
            Path(cert_file).write_bytes(cert_data)
        elif cert_file is not None:
            cert_file = _private_copy(cert_file, tmp, "cert.pem")
        if key_data is not None:
            key_file = os.path.join(tmp, "key.pem")
            Path(key_file).write_bytes(key_data)
        elif key_file is not None:
            key_file = _private_copy(key_file, tmp, "key.pem")
        assert cert_file is not None
        context.load_cert_chain(cert_file, key_file)


def _named(config: dict[str, Any], section: str, name: object, path: Path) -> dict[str, Any]:
    """The `section` entry (cluster, user, context) called `name` in a kubeconfig, or CredentialsError."""
    entries = config.get(section + "s") or []
    if not isinstance(entries, list):
        raise CredentialsError(f"kubeconfig {path}: {section}s is not a list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(section) or {}
            if not isinstance(body, dict):
                raise CredentialsError(f"kubeconfig {path}: {section} {name!r} is not a mapping")
            return body
    raise CredentialsError(f"kubeconfig {path}: no {section} named {name!r}")


def from_kubeconfig(path: Path) -> Credentials:
    """Server and credentials of the kubeconfig's current context: token, token file or client certificate."""
    try:
        config = load_yaml(read_text_file(path))
    except InputFileError as err:
        raise CredentialsError(f"cannot read kubeconfig {path}: {err.reason}") from None
    except YamlProblem as err:
        raise CredentialsError(f"kubeconfig {path}: {err}") from None
    if not isinstance(config, dict):
        raise CredentialsError(f"kubeconfig {path}: not a kubeconfig (expected a mapping)")
    current = config.get("current-context")
    if not current:
        raise CredentialsError(f"kubeconfig {path}: no current-context (set one with kubectl config use-context)")
    context = _named(config, "context", current, path)
    cluster = _named(config, "cluster", context.get("cluster"), path)
    user = _named(config, "user", context.get("user"), path) if context.get("user") else {}
    if not cluster.get("server"):
        raise CredentialsError(f"kubeconfig {path}: cluster {context.get('cluster')!r} has no server")
    if "exec" in user or "auth-provider" in user:
        raise CredentialsError(f"kubeconfig {path}: exec and auth-provider credentials are not supported; "
                               "use a token, a token file or a client certificate")
    base = path.parent
    where = f"kubeconfig {path}: cluster {shown(context.get('cluster'))}"
    ca_file, ca_data = _material(cluster, "certificate-authority", base, where)
    try:
        context_ssl = _ssl_context(ca_file, ca_data, bool(cluster.get("insecure-skip-tls-verify")))
    except (ssl.SSLError, OSError, ValueError) as err:
        raise CredentialsError(f"{where}: certificate authority {ca_file or '(certificate-authority-data)'}: "
                               f"{_reason(err)}") from None
    where = f"kubeconfig {path}: user {shown(context.get('user'))}"
    cert = _material(user, "client-certificate", base, where)
    key = _material(user, "client-key", base, where)
    try:
        _load_client_cert(context_ssl, cert, key)
    except InputFileError as err:  # the file that cannot be read, by name: the certificate's or the key's
        what = "client key" if key[0] is not None and err.path == Path(key[0]) else "client certificate"
        raise CredentialsError(f"{where}: {what} {err.path}: {_reason(err)}") from None
    except (ssl.SSLError, OSError, ValueError) as err:
        raise CredentialsError(f"{where}: client certificate {cert[0] or '(client-certificate-data)'} and its key: "
                               f"{_reason(err)}") from None
    # A relative tokenFile is relative to the kubeconfig, as kubectl reads it (and as the certificate paths are).
    token_file = base / user["tokenFile"] if user.get("tokenFile") else None
    return Credentials(str(cluster["server"]).rstrip("/"), context_ssl, user.get("token"), token_file)


def in_cluster() -> Credentials:
    """The pod's service account: the API server from the environment, the projected token and CA."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise CredentialsError("not running in a pod (KUBERNETES_SERVICE_HOST is not set); pass --kubeconfig")
    ca = SERVICE_ACCOUNT / "ca.crt"
    if not ca.exists():
        raise CredentialsError(f"no service-account CA at {ca}")
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    try:
        context = _ssl_context(str(ca), None, False)
    except (ssl.SSLError, OSError, ValueError) as err:
        raise CredentialsError(f"service-account CA {ca}: {_reason(err)}") from None
    return Credentials(server, context, token_file=SERVICE_ACCOUNT / "token")
