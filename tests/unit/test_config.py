"""The config file: defaults, NVIDIA-compatible keys, and one clear line per problem."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

import agent.reload
from agent.config import (
    DEFAULT_CONFIG,
    ConfigError,
    EmptyConfigFile,
    ResourcePattern,
    beside_kubelet,
    has_no_settings,
    load_config,
    parse_config,
)
from tests.plugin_harness import running_agent, wait_until


def test_defaults() -> None:
    assert load_config(None) == DEFAULT_CONFIG
    plugin = DEFAULT_CONFIG.flags.plugin
    assert (DEFAULT_CONFIG.flags.mig_strategy, plugin.device_list_strategy, plugin.device_id_strategy) == (
        "none", ("envvar",), "uuid"
    )


def test_the_pod_resources_socket_is_the_kubelets_beside_the_device_plugin_directory_unless_set() -> None:
    k0s = Path("/var/lib/k0s/kubelet/device-plugins")
    k0s_socket = Path("/var/lib/k0s/kubelet/pod-resources/kubelet.sock")
    assert beside_kubelet(DEFAULT_CONFIG, Path("/var/lib/kubelet/device-plugins")) == DEFAULT_CONFIG
    moved = beside_kubelet(DEFAULT_CONFIG, k0s)
    assert moved.mig.pod_resources_socket == k0s_socket
    assert "pod_resources_socket" not in moved.mig.model_fields_set  # still the default: not warned about at start
    assert moved.mig.model_copy(update={"pod_resources_socket": DEFAULT_CONFIG.mig.pod_resources_socket}) == (
        DEFAULT_CONFIG.mig)  # nothing else moved
    chosen = parse_config("version: v1\nmig:\n  podResourcesSocket: /run/kubelet/pr.sock\n  busyPolicy: wait\n")
    assert beside_kubelet(chosen, k0s) == chosen
    kept = beside_kubelet(parse_config("version: v1\nmig:\n  busyPolicy: wait\n"), k0s).mig
    assert (kept.busy_policy, kept.pod_resources_socket) == ("wait", k0s_socket)


def test_nvidia_key_names_are_accepted() -> None:
    config = parse_config(
        "version: v1\nflags:\n  migStrategy: none\n"
        "  plugin:\n    deviceListStrategy: cdi\n    deviceIDStrategy: index\n"
    )
    assert config.flags.plugin.device_list_strategy == ("cdi",)
    assert config.flags.plugin.device_id_strategy == "index"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: v2\n", "cfg.yaml: version: got 'v2'; expected 'v1'"),
        ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: volume-mount\n",
         "cfg.yaml: flags.plugin.deviceListStrategy[0]: got 'volume-mount'; expected 'envvar', 'volume-mounts', "
         "'cdi-annotations', 'cdi-cri' or 'cdi'"),
        ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: [cdi, cdi-cri]\n",
         "cfg.yaml: flags.plugin.deviceListStrategy: lists a strategy twice"),
        ("version: v1\nimex:\n  channelIDs: [1]\n", "cfg.yaml: imex.channelIDs: must be [] or [0], got [1]"),
        ("version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/mig-1g.10gb, replicas: 2}\n",
         "cfg.yaml: sharing.mps.resources: MPS shares whole GPUs only (nvidia.com/gpu), not nvidia.com/mig-1g.10gb"),
        ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
         "cfg.yaml: sharing.timeSlicing.resources[0].replicas: got 1; must be at least 2"),
        # One replica is no sharing at all: NVIDIA's plugin refuses fewer than 2 too, for MPS and MIG devices alike.
        ("version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
         "cfg.yaml: sharing.mps.resources[0].replicas: got 1; must be at least 2"),
        ("version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
         "    - {name: nvidia.com/gpu, replicas: 4}\n    - {name: nvidia.com/mig-1g.10gb, replicas: 1}\n",
         "cfg.yaml: sharing.timeSlicing.resources[1].replicas: got 1; must be at least 2"),
        ("version: v1\nresources:\n  gpus:\n  - {pattern: '*', name: GPU_H100}\n",
         "cfg.yaml: resources.gpus[0].name: 'nvidia.com/GPU_H100' is not a resource name under nvidia.com/ "
         "(lower case, digits, '-', '.')"),
        ("version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n"
         "  mps:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n",
         "cfg.yaml: sharing: timeSlicing and mps both share resources; a node uses one sharing strategy"),
        ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, envvar]\n",
         "cfg.yaml: flags.plugin.deviceListStrategy: lists a strategy twice"),
        ("version: v1\nflags:\n  migStrategee: none\n", "cfg.yaml: flags.migStrategee: unknown key"),
        ("version: v1\nflags:\n  migStrategy: split\n",
         "cfg.yaml: flags.migStrategy: got 'split'; expected 'none', 'single' or 'mixed'"),
        ("- version\n", "cfg.yaml: expected a mapping with 'version: v1' at the top level"),
        ("version: [\n",
         "cfg.yaml: invalid YAML: expected the node content, but found '<stream end>' (line 2, column 1)"),
    ],
)
def test_bad_config_is_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "cfg.yaml")
    assert str(caught.value).startswith(message)


def test_xid_keys_must_be_numbers() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\nhealth: {xid: {true: warn}}\n", "c")
    assert str(caught.value) == "c: health.xid: XIDs are numbers 1..1023, got the key True"
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\nhealth: {xid: {0: ignore, '13': warn}}\n", "c")
    assert str(caught.value) == "c: health.xid: XIDs are numbers 1..1023, got the key '13'"
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\nhealth: {xid: {0: ignore}}\n", "c")
    assert str(caught.value) == "c: health.xid[0]: bad key: got 0; must be at least 1"


def test_every_problem_gets_a_line() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\nflags:\n  bogus: 1\n  plugin:\n    deviceIDStrategy: serial\n", "c")
    assert str(caught.value).splitlines() == [
        "c: flags.plugin.deviceIDStrategy: got 'serial'; expected 'uuid' or 'index'",
        "c: flags.bogus: unknown key",
    ]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "nope.yaml")
    assert str(caught.value) == f"{tmp_path / 'nope.yaml'}: cannot read config: no such file"


def test_named_configs_in_a_directory(tmp_path: Path) -> None:
    (tmp_path / "default").write_text("version: v1\n")
    (tmp_path / "shared.yaml").write_text("version: v1\nflags: {plugin: {deviceIDStrategy: index}}\n")
    (tmp_path / "..data").mkdir()  # what a ConfigMap mount also holds
    assert load_config(tmp_path) == DEFAULT_CONFIG
    assert load_config(tmp_path, "shared").flags.plugin.device_id_strategy == "index"
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path, "other")
    assert str(caught.value) == f"{tmp_path}: no config named 'other' (known: default, shared)"
    (tmp_path / "default").unlink()
    (tmp_path / "more").write_text("version: v1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path}: no config named 'default' and no node label choosing one (known: more, shared)"
    )
    (tmp_path / "more").unlink()
    assert load_config(tmp_path).flags.plugin.device_id_strategy == "index"  # the only one


@pytest.mark.parametrize(("pattern", "text", "matches"), [
    ("*", "", True),
    ("*", "NVIDIA H100 80GB HBM3", True),
    ("NVIDIA*", "NVIDIA H100 80GB HBM3", True),
    ("*HBM3", "NVIDIA H100 80GB HBM3", True),
    ("*H100*", "NVIDIA H100 80GB HBM3", True),
    ("*h100*", "NVIDIA H100 80GB HBM3", False),  # case counts
    ("*H100", "NVIDIA H100 80GB HBM3", False),  # the whole name, not a part
    ("1g.10gb", "1g.10gb+me", False),
    ("1g.*", "1gx10gb", False),  # '.' is itself
    ("[1]g*", "[1]g.5gb", True),  # so are brackets
    ("1g.?gb", "1g.5gb", False),  # and '?'
    ("a**b", "ab", True),
    ("*a*b", "xaxbxb", True),
    ("*a*b", "xaxbxa", False),
    ("a*b*c", "abcbc", True),
    ("*" * 60 + "z", "a" * 60, False),
    ("*" * 60 + "a", "a" * 60, True),
])
def test_a_resource_pattern_matches_as_a_shell_wildcard(pattern: str, text: str, matches: bool) -> None:
    assert ResourcePattern(pattern=pattern, name="gpu").matches(text) is matches


def test_a_pattern_of_many_stars_is_matched_at_once() -> None:
    # A regular expression of 40 '.*' took hours on this; the matcher takes a few thousand steps.
    assert ResourcePattern(pattern="*" * 40 + "1g.*" + "*" * 40 + "0gc", name="gpu").matches("1g.10gb" * 4) is False


def test_integers_and_booleans_are_not_converted_from_other_types() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: 1\n    resources:\n"
                     "    - {name: gpu, replicas: '4'}\n    - {name: gpu, replicas: 4.0}\n"
                     "health: {recoveryChecks: true, sampleIntervalSeconds: '5'}\n", "c")
    assert str(caught.value).splitlines() == [
        "c: sharing.timeSlicing.renameByDefault: got 1; must be true or false",
        "c: sharing.timeSlicing.resources[0].replicas: got '4'; must be a whole number",
        "c: sharing.timeSlicing.resources[1].replicas: got 4.0; must be a whole number",
        "c: health.sampleIntervalSeconds: got '5'; must be a number",
        "c: health.recoveryChecks: got True; must be a whole number",
    ]
    config = parse_config("version: v1\nhealth: {sampleIntervalSeconds: 2, recoveryChecks: 4}\n")
    assert (config.health.sample_interval_seconds, config.health.recovery_checks) == (2, 4)


def test_a_name_given_to_two_kinds_of_device_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\nflags: {migStrategy: mixed}\nresources:\n"
                     "  gpus:\n  - {pattern: '*H100*', name: h100}\n  - {pattern: '*', name: mig-other}\n"
                     "  mig:\n  - {pattern: '*', name: h100}\nsharing:\n  timeSlicing:\n    resources:\n"
                     "    - {name: h100, replicas: 2, rename: mig-shared}\n"
                     "    - {name: mig-1g.10gb, replicas: 2, rename: mig-2g.20gb}\n"
                     "    - {name: mig-2g.20gb, replicas: 2, rename: h100}\n", "c")
    assert str(caught.value).splitlines() == [
        "c: resources.gpus[1].name: nvidia.com/mig-other is under nvidia.com/mig-, the names of MIG devices; whole "
        "GPUs need another name",
        "c: resources.mig[0].name: nvidia.com/h100 is the name of whole GPUs (resources.gpus[0]); with migStrategy "
        "mixed MIG devices need a name of their own",
        "c: sharing.timeSlicing.resources[0].rename: nvidia.com/mig-shared is under nvidia.com/mig-, the names of MIG "
        "devices; replicas of nvidia.com/h100 need another name",
        "c: sharing.timeSlicing.resources[1].rename: nvidia.com/mig-2g.20gb is the name of another resource "
        "(sharing.timeSlicing.resources[2].name); replicas of nvidia.com/mig-1g.10gb need a name of their own",
        "c: sharing.timeSlicing.resources[2].rename: nvidia.com/h100 is the name of whole GPUs (resources.gpus[0]); "
        "replicas of nvidia.com/mig-2g.20gb need a name of their own",
    ]
    # One kind of device under one name is no collision: MIG devices as nvidia.com/gpu under migStrategy single,
    # replicas renamed to a name of their own, MIG profiles grouped by resources.mig.
    parse_config("version: v1\nflags: {migStrategy: single}\nresources:\n  mig:\n  - {pattern: '*', name: gpu}\n")
    parse_config("version: v1\nflags: {migStrategy: mixed}\nresources:\n  mig:\n  - {pattern: '*', name: mig-any}\n"
                 "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2, rename: gpu-shared}\n"
                 "    - {name: mig-any, replicas: 2, rename: mig-any.shared}\n")


# --- an empty file: the defaults at start, refused at a reload


@pytest.mark.parametrize("text", ["", "\n  \n\n", "# shared GPUs\n# (the rest was never written)\n", "---\n",
                                  "null\n", "~"])
def test_a_file_with_no_settings_is_the_defaults_at_start_and_refused_where_a_reload_reads_it(tmp_path: Path,
                                                                                             text: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert has_no_settings(text)
    assert load_config(path) == DEFAULT_CONFIG
    with pytest.raises(EmptyConfigFile) as caught:
        load_config(path, empty_is_defaults=False)
    assert str(caught.value) == (
        f"{path}: the file is empty (no settings): at a reload that is taken for a failed or partial write, not for "
        "the defaults; to apply the defaults write 'version: v1' in it")
    assert caught.value.config == DEFAULT_CONFIG


@pytest.mark.parametrize("text", ["version: v1\n", "{}\n", "# the defaults, on purpose\nversion: v1\n",
                                  "---\nversion: v1\n...\n", "flags: {}\n"])
def test_a_mapping_that_sets_nothing_asks_for_the_defaults_at_a_reload_too(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert not has_no_settings(text)
    assert load_config(path, empty_is_defaults=False) == DEFAULT_CONFIG


REPLICATED = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
              "health:\n  sampleIntervalSeconds: 2\n")
"""32 time-sliced replicas of the 8 GPUs of a DGX H100, and a health policy of its own."""


async def test_a_config_file_cut_to_nothing_at_a_reload_keeps_the_config_in_force_until_the_defaults_are_asked_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent.reload, "CONFIG_POLL_S", 0.05)  # the file watch looks every 50 ms, not every 2 s
    path = tmp_path / "config.yaml"
    path.write_text(REPLICATED)
    async with running_agent("dgx-h100", load_config(path), config_path=path) as rig:
        before = rig.agent.bus.current.config
        assert len(rig.devices()) == 32
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="agent.daemon"):
            path.write_text("")  # a truncate, as a failed or cut-short write leaves the file: the file watch sees it
            await wait_until(lambda: any(i.kind == "config-rejected" for i in rig.agent.bus.current.incidents), 10,
                             "the empty file refused")
            await asyncio.sleep(0.5)  # ten more looks of the file watch: the file has not changed, nothing more
            lines = [r.getMessage() for r in caplog.records if r.name == "agent.daemon"]
        why = (f"{path}: the file is empty (no settings): at a reload that is taken for a failed or partial write, "
               "not for the defaults; to apply the defaults write 'version: v1' in it")
        assert lines == [f"config reload rejected; keeping the last good config: {why}"]
        assert rig.agent.bus.current.config == before
        assert rig.agent.bus.current.config.health.sample_interval_seconds == 2
        assert [i.message for i in rig.agent.bus.current.incidents if i.kind.startswith("config-")] == [
            f"config reload rejected: {why}"]
        assert len(rig.devices()) == 32 and sorted(rig.agent.plugins.plugins) == ["nvidia.com/gpu"]
        # SIGHUP reads it again, and refuses it again.
        assert await rig.agent.reload_config() is False
        assert rig.agent.bus.current.config == before

        path.write_text("version: v1\n")  # the defaults, asked for in so many words
        await wait_until(lambda: len(rig.devices()) == 8, 10, "the 8 whole GPUs of the defaults")
        after = rig.agent.bus.current.config
        assert (after.sharing, after.health, after.dra) == (DEFAULT_CONFIG.sharing, DEFAULT_CONFIG.health,
                                                            DEFAULT_CONFIG.dra)
        assert [i.kind for i in rig.agent.bus.current.incidents if i.kind.startswith("config-")] == [
            "config-rejected", "config-rejected", "config-applied"]
        # An empty file now changes nothing: the defaults are in force already.
        path.write_text("")
        assert await rig.agent.reload_config() is True
        assert [i.kind for i in rig.agent.bus.current.incidents if i.kind.startswith("config-")][-1] == (
            "config-applied")
