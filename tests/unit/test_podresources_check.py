"""mig.podResourcesSocket at start: a default path with no kubelet directory at all is not mentioned, the same path
set in the config is refused; a missing socket in an existing directory is a warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.podresources import SocketPathError, check_socket


def test_a_missing_directory_is_refused_only_when_the_path_was_configured(tmp_path: Path) -> None:
    socket = tmp_path / "no-kubelet" / "pod-resources" / "kubelet.sock"
    assert check_socket(socket, configured=False) is None
    with pytest.raises(SocketPathError) as refused:
        check_socket(socket, configured=True)
    assert str(refused.value) == (
        f"mig.podResourcesSocket {socket}: the directory {socket.parent} does not exist (the kubelet makes its socket "
        "in <kubelet root>/pod-resources; mount that directory into the container)")


def test_a_socket_not_there_yet_is_a_warning_either_way(tmp_path: Path) -> None:
    socket = tmp_path / "kubelet.sock"
    warning = (f"mig.podResourcesSocket {socket} does not exist yet (the kubelet makes it): until it does, MIG changes "
               "do not check for pods on the GPUs and GPU metrics carry no pod labels")
    assert check_socket(socket, configured=False) == warning
    assert check_socket(socket, configured=True) == warning


def test_a_dangling_link_is_a_socket_not_there_yet(tmp_path: Path) -> None:
    socket = tmp_path / "kubelet.sock"
    socket.symlink_to(tmp_path / "elsewhere.sock")
    assert check_socket(socket) == (
        f"mig.podResourcesSocket {socket} does not exist yet (the kubelet makes it): until it does, MIG changes do "
        "not check for pods on the GPUs and GPU metrics carry no pod labels")
