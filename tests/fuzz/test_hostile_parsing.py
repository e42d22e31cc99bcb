"""Input files built to cost the agent: YAML aliases that expand without end, values far longer than any
message should quote, wildcard patterns that make a regular expression backtrack, numbers and booleans written
as the wrong type, and resource names that would put two kinds of device into one resource. Through the real
CLI, each is one short line (or a withheld resource with its reason), answered at once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.builders import gpu_agent, one_line, run_agent

MAX_LINE = 300
"""No line about a bad file is longer than this (beside the file's own name), whatever the file holds."""


def short_line(result: subprocess.CompletedProcess[str], file: Path) -> str:
    """The one line a refused command prints about `file`, checked to be short."""
    line = one_line(result)
    assert len(line.replace(str(file), "", 1)) < MAX_LINE, line[:1000]
    return line


def bomb() -> str:
    """Nine nested anchors, each a list of the one before and eight aliases to it ("billion laughs"): 326 bytes
    of YAML that stand for over 40 million values."""
    text = "&a [x, x, x, x, x, x, x, x, x]"
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        text = f"&{name} [{text}" + f", *{prev}" * 8 + "]"
    return text


SHARED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 2\n"
"""A config whose last line is a sharing entry's; tests add its `devices`."""


def simulated(*args: str) -> dict[str, Any]:
    result = gpu_agent("simulate", "--json", *args, timeout=30)
    assert result.returncode == 0, result.stderr
    view: dict[str, Any] = json.loads(result.stdout)
    return view


# --- aliases ---------------------------------------------------------------------------------------------


def test_an_alias_bomb_in_a_config_is_refused_before_it_expands(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(SHARED + f"      devices: [{bomb()}]\n")
    assert config.stat().st_size < 1024
    reason = "invalid YAML: aliases expand to more than 100000 values (line 7, column 213)"
    assert short_line(run_agent(kubelet_dir, "--config", str(config)), config) == (
        f"gpu-agent run: error: {config}: {reason}")
    assert short_line(gpu_agent("simulate", "--node", "dgx-h100", "--config", str(config), timeout=20), config) == (
        f"gpu-agent simulate: error: {config}: {reason}")
    # Anchors as people use them still load.
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                      "    - {name: gpu, replicas: &four 4, devices: &first [0, 1]}\n"
                      "    - {name: gpu, replicas: *four, rename: gpu-b, devices: [2, 3]}\n"
                      "    - {name: gpu, replicas: 2, rename: gpu-c, devices: [4, 5]}\n")
    assert simulated("--node", "dgx-h100", "--config", str(config))["node"]["capacity"] == {
        "nvidia.com/gpu": "10", "nvidia.com/gpu-b": "8", "nvidia.com/gpu-c": "4"}


def test_an_alias_bomb_in_a_layouts_file_is_refused_before_it_expands(tmp_path: Path) -> None:
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text(f"version: v1\nmig-configs:\n  x: {bomb()}\n")
    result = gpu_agent("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", str(layouts), "--layout", "x",
                       timeout=20)
    assert short_line(result, layouts) == (
        f"gpu-agent mig: error: {layouts}: invalid YAML: aliases expand to more than 100000 values "
        "(line 3, column 202)")
    layouts.write_text("version: v1\nmig-configs:\n"
                       "  small:\n    - devices: all\n      mig-enabled: true\n      mig-devices: &seven {1g.18gb: 7}\n"
                       "  again:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: *seven\n")
    planned = gpu_agent("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", str(layouts), "--layout",
                        "again", "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["feasible"] is True


def test_an_alias_bomb_in_a_node_file_is_refused_before_it_expands(tmp_path: Path) -> None:
    node = tmp_path / "node.yaml"
    node.write_text(f"version: v1\nname: {bomb()}\ngpus:\n  - {{model: A100-SXM4-80GB, numa_node: 0}}\n")
    reason = "invalid YAML: aliases expand to more than 100000 values (line 2, column 203)"
    assert short_line(gpu_agent("simulate", "--node", str(node), timeout=20), node) == (
        f"gpu-agent simulate: error: {node}: {reason}")
    assert short_line(gpu_agent("inspect", "--nvml", f"mock:{node}", timeout=20), node) == (
        f"gpu-agent inspect: error: {node}: {reason}")


def test_more_than_a_thousand_aliases_are_refused_at_the_one_too_many(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(SHARED + "      devices:\n      - &a 0\n" + "      - *a\n" * 1001)
    assert short_line(gpu_agent("simulate", "--node", "dgx-h100", "--config", str(config), timeout=20), config) == (
        f"gpu-agent simulate: error: {config}: invalid YAML: more than 1000 aliases (line 1009, column 9)")


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(SHARED + "      devices: &loop [0, *loop]\n")
    assert short_line(gpu_agent("simulate", "--node", "dgx-h100", "--config", str(config), timeout=20), config) == (
        f"gpu-agent simulate: error: {config}: invalid YAML: an alias refers to a value that contains it "
        "(line 7, column 26)")


def test_nesting_past_sixty_four_levels_is_refused_where_it_starts(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags:\n  migStrategy: " + "[" * 10_000 + "\n")
    assert short_line(run_agent(kubelet_dir, "--config", str(config)), config) == (
        f"gpu-agent run: error: {config}: invalid YAML: nested more than 64 levels deep (line 3, column 78)")
    # Sixty-four levels are read (and refused for what they hold, not for their depth).
    config.write_text("version: v1\nflags:\n  migStrategy: " + "[" * 62 + "]" * 62 + "\n")
    assert short_line(run_agent(kubelet_dir, "--config", str(config)), config).startswith(
        f"gpu-agent run: error: {config}: flags.migStrategy: got [[[[")


# --- files of many problems, and characters that do not print -------------------------------------------


def test_a_config_of_many_problems_lists_ten_and_counts_the_rest(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags:\n" + "".join(f"  k{i:02d}: 1\n" for i in range(25)))
    result = run_agent(kubelet_dir, "--config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if " INFO agent." not in line]
    assert lines == [f"gpu-agent run: error: {config}: flags.k00: unknown key",
                     *(f"{config}: flags.k{i:02d}: unknown key" for i in range(1, 10)),
                     "... and 15 more problems"]


def test_a_layouts_file_of_many_problems_is_one_line_for_mig(tmp_path: Path) -> None:
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text("version: v1\nmig-configs:\n" + "".join(f"  l{i:02d}: []\n" for i in range(30)))
    result = gpu_agent("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", str(layouts), "--layout", "l00")
    assert short_line(result, layouts) == (
        f"gpu-agent mig: error: {layouts}: mig-configs.l00: must have at least 1 entry; {layouts}: mig-configs.l01: "
        "must have at least 1 entry; and 28 more problems")


def test_a_key_that_does_not_print_is_quoted_by_its_escapes(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags:\n  \u202eyek\u200b: 1\n", encoding="utf-8")
    assert short_line(run_agent(kubelet_dir, "--config", str(config)), config) == (
        f"gpu-agent run: error: {config}: flags.\\u202eyek\\u200b: unknown key")
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text('version: v1\nmig-configs:\n  "l\\u202e0\\ud800": [{devices: all, mig-enabled: false}]\n',
                       encoding="utf-8")
    result = gpu_agent("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", str(layouts), "--layout", "x")
    line = short_line(result, layouts)
    assert line.isprintable() and "mig-configs.l\\u202e0\\ud800: " in line, line


# --- files larger than their limit ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["node", "layouts", "kubeconfig"])
def test_a_file_over_sixty_four_kib_is_refused_by_its_size(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.yaml"
    path.write_text("version: v1\n#" + "x" * (64 * 1024 - 13) + "\n")
    assert path.stat().st_size == 64 * 1024 + 1
    command = {
        "node": ("inspect", "--nvml", f"mock:{path}"),
        "layouts": ("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", str(path), "--layout", "x"),
        "kubeconfig": ("run", "--nvml", "mock:single-h200", "--kubelet-dir", str(tmp_path), "--metrics-port", "0",
                       "--node-name", "n", "--kubeconfig", str(path)),
    }[kind]
    line = short_line(gpu_agent(*command), path)
    assert line.endswith(f"{path}: larger than 64 KiB; not read"), line


KUBECONFIG = """apiVersion: v1
current-context: ctx
clusters:
- {name: c, cluster: {server: "https://127.0.0.1:6443", CLUSTER}}
users:
- {name: u, user: {token: abc, USER}}
contexts:
- {name: ctx, context: {cluster: c, user: u}}
"""


@pytest.mark.parametrize(("cluster", "user", "reason"), [
    ("certificate-authority-data: 'not base64!'", "x: 1", "cluster 'c': certificate-authority-data is not base64"),
    ("certificate-authority-data: 7", "x: 1", "cluster 'c': certificate-authority-data must be a string, got 7"),
    ("certificate-authority-data: aGVsbG8=", "x: 1",
     "cluster 'c': certificate authority (certificate-authority-data): not PEM that OpenSSL accepts"),
    ("certificate-authority: /nonexistent/ca.pem", "x: 1",
     "cluster 'c': certificate authority /nonexistent/ca.pem: no such file or directory"),
    ("insecure-skip-tls-verify: true", "client-certificate-data: aGVsbG8=, client-key-data: aGVsbG8=",
     "user 'u': client certificate (client-certificate-data) and its key: not PEM that OpenSSL accepts"),
])
def test_a_kubeconfig_whose_tls_material_cannot_be_used_is_one_line(tmp_path: Path, kubelet_dir: Path, cluster: str,
                                                                    user: str, reason: str) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.replace("CLUSTER", cluster).replace("USER", user))
    result = gpu_agent("run", "--nvml", "mock:single-h200", "--kubelet-dir", str(kubelet_dir), "--metrics-port", "0",
                       "--node-name", "n", "--kubeconfig", str(kubeconfig), timeout=30)
    assert short_line(result, kubeconfig) == (
        f"gpu-agent run: error: cannot load API server credentials: kubeconfig {kubeconfig}: {reason}")


def test_a_mock_state_holding_a_number_too_long_to_read_is_one_line(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    state.write_text('{"format": 1, "gpus": {}, "next_seq": 1' + "0" * 5000 + "}\n")
    assert short_line(gpu_agent("inspect", "--nvml", "mock:single-h200", "--mock-state", str(state)), state) == (
        f"gpu-agent inspect: error: mock state {state}: not a fake NVML state file (a number too long to read); "
        "delete it to start the simulated node afresh")


# --- values too long to quote whole ----------------------------------------------------------------------


def test_a_long_value_is_quoted_by_its_start_and_its_length(tmp_path: Path, kubelet_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags:\n  plugin:\n    cdiAnnotationPrefix: " + "x" * 5000 + "\n")
    assert short_line(run_agent(kubelet_dir, "--config", str(config)), config) == (
        f"gpu-agent run: error: {config}: flags.plugin.cdiAnnotationPrefix: '{'x' * 60}'... (5000 characters) is "
        "not an annotation key prefix (a DNS subdomain followed by '/')")
    config.write_text("version: v1\nhealth:\n  recoveryChecks: [" + ", ".join(["7"] * 5000) + "]\n")
    assert short_line(run_agent(kubelet_dir, "--config", str(config)), config) == (
        f"gpu-agent run: error: {config}: health.recoveryChecks: got [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, ...] "
        "(5000 items); must be a whole number")


def test_a_long_sharing_selector_is_refused_quoting_its_start(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(SHARED + "      devices: [" + "G" * 5000 + "]\n")
    assert short_line(gpu_agent("simulate", "--node", "dgx-h100", "--config", str(config)), config) == (
        f"gpu-agent simulate: error: {config}: sharing.timeSlicing.resources[0].devices: '{'G' * 60}'... "
        "(5000 characters) is not a GPU index, UUID or model (those are at most 96 characters)")


def test_a_long_value_in_a_layouts_file_is_quoted_by_its_start(tmp_path: Path) -> None:
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text("version: v1\nmig-configs: [" + ", ".join(["3"] * 5000) + "]\n")
    result = gpu_agent("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", str(layouts), "--layout", "x")
    assert short_line(result, layouts) == (
        f"gpu-agent mig: error: {layouts}: mig-configs: must be a mapping of layout names to entry lists, got "
        "[3, 3, 3, 3, 3, 3, 3, 3, 3, 3, ...] (5000 items)")
    layouts.write_text("version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n"
                       "      device-filter: '0x" + "f" * 5000 + "'\n")
    result = gpu_agent("mig", "plan", "--nvml", "mock:single-h200", "--mig-config", str(layouts), "--layout", "x")
    assert short_line(result, layouts) == (
        f"gpu-agent mig: error: {layouts}: mig-configs.x[0].device-filter: a PCI device id is 0x and 8 hex digits, "
        f"device id then vendor id (e.g. 0x233010DE), got '0x{'f' * 58}'... (5002 characters)")


def test_a_long_value_in_a_node_file_is_quoted_by_its_start(tmp_path: Path) -> None:
    node = tmp_path / "node.yaml"
    node.write_text("version: v1\nname: " + "n" * 300 + "\ngpus:\n  - {model: A100-SXM4-80GB, numa_node: 0}\n")
    assert short_line(gpu_agent("simulate", "--node", str(node)), node) == (
        f"gpu-agent simulate: error: {node}: name: must be a lowercase DNS name such as gpu-node-1, got "
        f"'{'n' * 60}'... (300 characters)")
    node.write_text("version: v1\ngpus:\n  - {model: A100-SXM4-80GB, numa_node: 0, uuid: [" + "1, " * 4999
                    + "1]}\n")
    assert short_line(gpu_agent("inspect", "--nvml", f"mock:{node}"), node) == (
        f"gpu-agent inspect: error: {node}: gpus[0].uuid: must be a string, got [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, ...] "
        "(5000 items)")


# --- wildcard patterns -----------------------------------------------------------------------------------


def test_a_run_of_stars_in_a_resource_pattern_is_matched_at_once(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nresources:\n  gpus:\n  - {pattern: '" + "*" * 50 + "!', name: h200}\n")
    view = simulated("--node", "single-h200", "--config", str(config))  # a regular expression took hours
    assert view["node"]["capacity"] == {}
    assert view["events"] == [{"type": "Warning", "reason": "ResourcesWithheld",
                               "message": "GPU 0 (NVIDIA H200) matches no pattern of resources.gpus; not advertised"}]
    config.write_text("version: v1\nresources:\n  gpus:\n  - {pattern: '" + "*" * 50 + "H*0', name: h200}\n")
    assert simulated("--node", "single-h200", "--config", str(config))["node"]["capacity"] == {"nvidia.com/h200": "1"}


def test_a_run_of_stars_in_a_mig_pattern_is_matched_at_once(tmp_path: Path) -> None:
    state = mig_node(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags: {migStrategy: mixed}\nresources:\n  mig:\n"
                      "  - {pattern: '" + "*" * 40 + "1g.*" + "*" * 40 + "0gc', name: mig-small}\n"
                      "  - {pattern: '1" + "*" * 50 + "gb', name: mig-one}\n")
    capacity = simulated("--node", "dgx-h100", "--mock-state", str(state), "--config", str(config))["node"]["capacity"]
    assert capacity == {"nvidia.com/gpu": "4", "nvidia.com/mig-one": "28"}


# --- wrong types -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("section", "line"), [
    ("sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: '4'}\n",
     "sharing.timeSlicing.resources[0].replicas: got '4'; must be a whole number"),
    ("sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2.0}\n",
     "sharing.timeSlicing.resources[0].replicas: got 2.0; must be a whole number"),
    ("sharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: true}\n",
     "sharing.mps.resources[0].replicas: got True; must be a whole number"),
    ("health:\n  recoveryChecks: true\n", "health.recoveryChecks: got True; must be a whole number"),
    ("health:\n  nodeFatalUnhealthyGpus: '2'\n", "health.nodeFatalUnhealthyGpus: got '2'; must be a whole number"),
    ("health:\n  sampleIntervalSeconds: '5'\n", "health.sampleIntervalSeconds: got '5'; must be a number"),
    ("telemetry:\n  intervalSeconds: true\n", "telemetry.intervalSeconds: got True; must be a number"),
    ("mig:\n  busyWaitSeconds: '60'\n", "mig.busyWaitSeconds: got '60'; must be a number"),
    ("imex:\n  channelIDs: ['0']\n", "imex.channelIDs[0]: got '0'; must be a whole number"),
    ("flags:\n  failOnInitError: 0\n", "flags.failOnInitError: got 0; must be true or false"),
    ("flags:\n  plugin:\n    passDeviceSpecs: 'yes'\n",
     "flags.plugin.passDeviceSpecs: got 'yes'; must be true or false"),
    ("sharing:\n  timeSlicing:\n    renameByDefault: 'true'\n",
     "sharing.timeSlicing.renameByDefault: got 'true'; must be true or false"),
    ("dra:\n  enabled: 1\n", "dra.enabled: got 1; must be true or false"),
    ("telemetry:\n  dcgmMetrics: 'off'\n", "telemetry.dcgmMetrics: got 'off'; must be true or false"),
])
def test_a_value_of_the_wrong_type_is_refused_not_converted(tmp_path: Path, kubelet_dir: Path, section: str,
                                                             line: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n" + section)
    assert short_line(run_agent(kubelet_dir, "--config", str(config)), config) == (
        f"gpu-agent run: error: {config}: {line}")


def test_seconds_take_whole_numbers_but_not_text(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nhealth: {sampleIntervalSeconds: 1, recoveryChecks: 2}\n"
                      "telemetry: {intervalSeconds: 30}\nmig: {busyWaitSeconds: 0}\n")
    assert simulated("--node", "single-h200", "--config", str(config))["node"]["capacity"] == {"nvidia.com/gpu": "1"}
    config.write_text("version: v1\nhealth: {sampleIntervalSeconds: '1'}\n")
    assert short_line(gpu_agent("simulate", "--node", "single-h200", "--config", str(config)), config) == (
        f"gpu-agent simulate: error: {config}: health.sampleIntervalSeconds: got '1'; must be a number")


def test_mps_takes_at_most_a_hundred_replicas_a_whole_percent_each(tmp_path: Path, kubelet_dir: Path) -> None:
    # Each MPS client gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 // replicas: 101 replicas would get 0%.
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: 101}\n")
    assert short_line(run_agent(kubelet_dir, "--config", str(config)), config) == (
        f"gpu-agent run: error: {config}: sharing.mps.resources[0].replicas: got 101; MPS gives each replica a "
        "whole percentage of the GPU's threads, so at most 100 replicas")
    config.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: 100}\n")
    labels = simulated("--node", "single-h200", "--config", str(config))["node"]["labels"]
    assert (labels["nvidia.com/gpu.sharing-strategy"], labels["nvidia.com/gpu.replicas"]) == ("mps", "100")
    # Time-slicing has no percentage: 101 replicas are fine there.
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 101}\n")
    assert simulated("--node", "single-h200", "--config", str(config))["node"]["capacity"] == {
        "nvidia.com/gpu": "101"}


# --- one kind of device per resource ---------------------------------------------------------------------


def mig_node(tmp_path: Path) -> Path:
    """A simulated DGX H100 whose GPUs 0-3 have seven 1g.10gb MIG devices each and GPUs 4-7 no MIG: its mock
    state file."""
    layouts = tmp_path / "half.yaml"
    layouts.write_text("version: v1\nmig-configs:\n  half:\n"
                       "    - {devices: [0, 1, 2, 3], mig-enabled: true, mig-devices: {1g.10gb: 7}}\n"
                       "    - {devices: [4, 5, 6, 7], mig-enabled: false}\n")
    state = tmp_path / "nvml.json"
    applied = gpu_agent("mig", "apply", "--nvml", "mock:dgx-h100", "--mock-state", str(state), "--mig-config",
                        str(layouts), "--layout", "half", "--state-dir", str(tmp_path / "mig"))
    assert applied.returncode == 0, applied.stderr
    return state


@pytest.mark.parametrize(("section", "line"), [
    ("flags: {migStrategy: mixed}\nresources:\n  mig:\n  - {pattern: '*', name: gpu}\n",
     "resources.mig[0].name: nvidia.com/gpu is the name of whole GPUs; with migStrategy mixed MIG devices need a "
     "name of their own"),
    ("flags: {migStrategy: mixed}\nresources:\n  gpus:\n  - {pattern: '*', name: gpu-all}\n"
     "  mig:\n  - {pattern: '1g.*', name: mig-small}\n  - {pattern: '*', name: gpu-all}\n",
     "resources.mig[1].name: nvidia.com/gpu-all is the name of whole GPUs (resources.gpus[0]); with migStrategy "
     "mixed MIG devices need a name of their own"),
    ("resources:\n  gpus:\n  - {pattern: '*', name: mig-1g.10gb}\n",
     "resources.gpus[0].name: nvidia.com/mig-1g.10gb is under nvidia.com/mig-, the names of MIG devices; whole "
     "GPUs need another name"),
    ("flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n"
     "    - {name: gpu, replicas: 2, rename: mig-1g.10gb}\n",
     "sharing.timeSlicing.resources[0].rename: nvidia.com/mig-1g.10gb is under nvidia.com/mig-, the names of MIG "
     "devices; replicas of nvidia.com/gpu need another name"),
    ("flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n"
     "    - {name: mig-1g.10gb, replicas: 2, rename: gpu}\n",
     "sharing.timeSlicing.resources[0].rename: nvidia.com/gpu is the name of whole GPUs; replicas of "
     "nvidia.com/mig-1g.10gb need a name of their own"),
    ("flags: {migStrategy: mixed}\nsharing:\n  mps:\n    resources:\n"
     "    - {name: gpu, replicas: 2, devices: [4], rename: mig-1g.10gb.shared}\n",
     "sharing.mps.resources[0].rename: nvidia.com/mig-1g.10gb.shared is under nvidia.com/mig-, the names of MIG "
     "devices; replicas of nvidia.com/gpu need another name"),
    ("flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n"
     "    - {name: gpu, replicas: 2, devices: [4]}\n    - {name: mig-1g.10gb, replicas: 2, rename: gpu.x}\n"
     "    - {name: gpu.x, replicas: 3}\n",
     "sharing.timeSlicing.resources[1].rename: nvidia.com/gpu.x is the name of another resource "
     "(sharing.timeSlicing.resources[2].name); replicas of nvidia.com/mig-1g.10gb need a name of their own"),
])
def test_a_config_that_names_two_kinds_of_device_alike_is_refused(tmp_path: Path, section: str, line: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n" + section)
    state = mig_node(tmp_path)
    result = gpu_agent("simulate", "--node", "dgx-h100", "--mock-state", str(state), "--config", str(config))
    assert short_line(result, config) == f"gpu-agent simulate: error: {config}: {line}"


def test_a_resource_the_node_would_fill_with_two_kinds_of_device_is_withheld(tmp_path: Path) -> None:
    state = mig_node(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n"
                      "    - {name: gpu, replicas: 2, rename: shared, devices: [4]}\n"
                      "    - {name: mig-1g.10gb, replicas: 2, rename: shared, devices: 2}\n")
    view = simulated("--node", "dgx-h100", "--mock-state", str(state), "--config", str(config))
    assert view["node"]["capacity"] == {"nvidia.com/gpu": "3", "nvidia.com/mig-1g.10gb": "26"}
    assert view["events"] == [{"type": "Warning", "reason": "ResourcesWithheld", "message": (
        "nvidia.com/shared would hold replicas of nvidia.com/mig-1g.10gb and replicas of nvidia.com/gpu; a "
        "resource holds one kind of device, so it is not advertised")}]
    # Devices shared in part keep their resource: replicas beside the devices left whole.
    config.write_text("version: v1\nflags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n"
                      "    - {name: gpu, replicas: 4, devices: [4]}\n"
                      "    - {name: mig-1g.10gb, replicas: 2, devices: 2}\n")
    view = simulated("--node", "dgx-h100", "--mock-state", str(state), "--config", str(config))
    assert view["node"]["capacity"] == {"nvidia.com/gpu": "7", "nvidia.com/mig-1g.10gb": "30"}
    assert view["events"] == []
