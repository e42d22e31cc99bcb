"""The Kubernetes releases the rig pins (hack/testbin/kube/<release>/, hack/testbin/etcd/<release>/): the default
release is the newest GA one and is marked (hack/testbin/kube/default), hack/testbin/release.sh and
tests/releases.py pick the same release for every KUBE, each pin builds with a Go toolchain it names where it needs
one, and what tests/releases.py says each release locks."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests import releases
from tests.releases import (
    DEFAULT_ON_FROM,
    LOCKED_ON_FROM,
    REPO,
    can_turn_off,
    default_release,
    emulation_to_turn_off,
    gates_turned_off,
    kube_release,
    pinned_kubernetes,
)

GA = re.compile(r"v\d+\.\d+\.\d+")
"""A GA release of k8s.io/kubernetes: no -alpha.N, -beta.N or -rc.N."""


def shell(function: str, kube: str | None = None) -> subprocess.CompletedProcess[str]:
    """A function of hack/testbin/release.sh, run as hack/testbin.sh and hack/test.sh run it."""
    env = {k: v for k, v in os.environ.items() if k != "KUBE"}
    if kube is not None:
        env["KUBE"] = kube
    script = f'repo_root={REPO}; source "$repo_root/hack/testbin/release.sh"; {function}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=False)


def gomod(path: Path) -> dict[str, str]:
    """The go, toolchain and godebug lines of a go.mod."""
    lines = (line.split(None, 1) for line in path.read_text().splitlines())
    return {words[0]: words[1].strip() for words in lines if len(words) == 2 and words[0] in
            ("go", "toolchain", "godebug")}


def version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.removeprefix("go").split("."))


# --- the default release


def test_the_default_release_is_the_newest_ga_release_pinned_and_a_beta_is_not_it() -> None:
    pins = {release: pinned_kubernetes(release) for release in releases.releases()}
    assert pins == {"1.35": "v1.35.4", "1.36": "v1.36.3", "1.37": "v1.37.2", "1.38": "v1.38.0-beta.0"}
    assert GA.fullmatch(pins[default_release()]), pins[default_release()]
    assert default_release() == max((r for r, pin in pins.items() if GA.fullmatch(pin)), key=version) == "1.37"


def test_both_pickers_take_the_marked_default_without_kube_and_any_pinned_release_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBE", raising=False)
    assert (shell("kube_release").stdout, kube_release()) == ("1.37\n", "1.37")
    for kube, want in [("1.35", "1.35"), ("1.36", "1.36"), ("1.37", "1.37"), ("1.38", "1.38"), ("v1.38", "1.38")]:
        monkeypatch.setenv("KUBE", kube)
        assert (shell("kube_release", kube).stdout, kube_release()) == (f"{want}\n", want)
    monkeypatch.setenv("KUBE", "1.34")
    refused = shell("kube_release", "1.34")
    with pytest.raises(RuntimeError) as python_refused:
        kube_release()
    assert (refused.returncode, refused.stderr) == (1, "KUBE=1.34: no such release here (known: 1.35 1.36 1.37 1.38)\n")
    assert str(python_refused.value) == "KUBE=1.34: no such release here (known: 1.35 1.36 1.37 1.38)"


def test_make_test_runs_the_matrix_on_the_oldest_release_which_is_ga() -> None:
    oldest = shell("kube_oldest_release").stdout.strip()
    assert (oldest, shell("kube_releases").stdout.split()) == ("1.35", ["1.35", "1.36", "1.37", "1.38"])
    assert GA.fullmatch(pinned_kubernetes(oldest))
    assert "oldest=$(kube_oldest_release)" in (REPO / "hack" / "test.sh").read_text()


def test_a_default_naming_no_pinned_release_is_refused_by_both(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    kube = tmp_path / "hack" / "testbin" / "kube"
    (kube / "1.37").mkdir(parents=True)
    (kube / "1.37" / "go.mod").write_text("module x\n")
    (kube / "default").write_text("# the default\n\n1.39\n")
    monkeypatch.delenv("KUBE", raising=False)
    monkeypatch.setattr(releases, "KUBE_PINS", kube)
    with pytest.raises(RuntimeError) as refused:
        kube_release()
    assert str(refused.value) == "hack/testbin/kube/default names no release with pins (known: 1.37)"
    script = f'repo_root={tmp_path}; source "{REPO}/hack/testbin/release.sh"; kube_release'
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False,
                         env={k: v for k, v in os.environ.items() if k != "KUBE"})
    assert (run.returncode, run.stdout, run.stderr) == (
        1, "", "hack/testbin/kube/default names no release with pins (known: 1.37)\n")


def test_the_kubelet_harness_pins_the_default_release() -> None:
    """tests/kubelet builds the kubelet's device manager: the same k8s.io/kubernetes as the default release, so
    that moving the default moves it too (tests/README.md, "A new Kubernetes release")."""
    harness = (REPO / "tests" / "kubelet" / "go.mod").read_text()
    assert re.search(rf"^\s+k8s\.io/kubernetes {re.escape(pinned_kubernetes(default_release()))}$", harness, re.M)


# --- the pins and their Go


def test_every_release_has_etcd_pins_and_a_go_it_can_build_with() -> None:
    for release in releases.releases():
        assert (REPO / "hack" / "testbin" / "etcd" / release / "go.mod").is_file(), release
    # 1.38 says go 1.27.0, newer than the machine's 1.26: its go.mod names the toolchain hack/testbin/lib.sh uses.
    assert gomod(REPO / "hack" / "testbin" / "kube" / "1.38" / "go.mod") == {
        "go": "1.27.0", "toolchain": "go1.27.3", "godebug": "default=go1.27"}
    assert "toolchain" not in gomod(REPO / "hack" / "testbin" / "kube" / "1.37" / "go.mod")
    modules = [*REPO.glob("hack/testbin/*/*/go.mod"), *REPO.glob("hack/testbin/*/go.mod"),
               REPO / "tests" / "kubelet" / "go.mod", REPO / "hack" / "cluster" / "containerd" / "go.mod"]
    for path in modules:
        lines = gomod(path)
        if "toolchain" in lines:  # an exact Go release, at least what the go line asks
            assert re.fullmatch(r"go1\.\d+\.\d+", lines["toolchain"]), path
            assert version(lines["toolchain"]) >= version(lines["go"]), path
        else:
            assert version(lines["go"]) < (1, 27), f"{path} needs go {lines['go']} and names no toolchain"


def test_the_138_kubelets_iptables_wrappers_is_the_module_kept_here() -> None:
    pins = (REPO / "hack" / "testbin" / "kube" / "1.38" / "go.mod").read_text()
    assert "\tsigs.k8s.io/iptables-wrappers => ./iptables-wrappers\n" in pins
    stand_in = REPO / "hack" / "testbin" / "kube" / "1.38" / "iptables-wrappers"
    assert (stand_in / "go.mod").read_text().splitlines()[4] == "module sigs.k8s.io/iptables-wrappers"
    assert (stand_in / "README.md").is_file()


# --- what each release locks


def test_the_gates_138_locks_on() -> None:
    assert {gate: release for gate, release in LOCKED_ON_FROM.items() if release == (1, 38)} == {
        "DRADeviceTaints": (1, 38), "DRADeviceTaintRules": (1, 38), "DRAPartitionableDevices": (1, 38),
        "DRADeviceBindingConditions": (1, 38)}
    for gate, locked in LOCKED_ON_FROM.items():  # locked on: on by default by then
        assert DEFAULT_ON_FROM[gate] <= locked, gate
    assert can_turn_off("DRAConsumableCapacity", (1, 38))  # GA in 1.38, locked only from 1.39
    assert [can_turn_off("DRADeviceTaints", (1, minor)) for minor in (35, 36, 37, 38)] == [True, True, True, False]


def test_a_gate_turned_off_that_the_release_locked_is_had_by_emulating_the_last_release_that_could() -> None:
    taints = "DRADeviceTaints=false,DRADeviceTaintRules=false"
    assert gates_turned_off(taints + ",DRAPartitionableDevices=true") == ["DRADeviceTaints", "DRADeviceTaintRules"]
    assert [emulation_to_turn_off(taints, (1, minor)) for minor in (35, 36, 37, 38)] == [None, None, None, (1, 37)]
    assert emulation_to_turn_off("DRAPartitionableDevices=false", (1, 38)) == (1, 37)
    assert emulation_to_turn_off("DRAConsumableCapacity=false", (1, 38)) is None
    assert emulation_to_turn_off("DRAExtendedResource=false,DRADeviceTaints=false", (1, 38)) == (1, 36)
    assert emulation_to_turn_off("DRADeviceTaints=true", (1, 38)) is None
    with pytest.raises(ValueError) as too_far:
        emulation_to_turn_off("DRAExtendedResource=false", (1, 41))
    assert str(too_far.value) == ("DRAExtendedResource=false: Kubernetes 1.41 emulates releases back to 1.38 only, "
                                  "and the gates are locked on from 1.37")
