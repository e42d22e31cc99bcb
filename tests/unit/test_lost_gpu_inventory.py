"""A lost GPU at the NVML boundary: the fake shows both shapes NVML has (no handle; a handle whose every call fails
with GPU_IS_LOST), the backend lists every GPU NVML counts under its NVML index (a lost one with what was last
read of it), and gpus.json keeps what was read for a later agent, refusing a file it cannot use in one line."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pynvml
import pytest

from agent.cli import main
from agent.nvml.backend import fake_backend
from agent.nvml.fake import FakeNvml
from agent.nvml.identity import IDENTITY_FILE, load_identities, save_identities
from agent.nvml.mig_ops import MigCallError, MigOps
from agent.nvml.nodefile import load_node

PRESET = load_node("dgx-h100")
UUIDS = [g.uuid for g in PRESET.gpus]
BUS_IDS = [g.pci_bus_id for g in PRESET.gpus]


def lost_code(call: object) -> int:
    with pytest.raises(pynvml.NVMLError) as caught:
        call()  # type: ignore[operator]
    return int(caught.value.value)


def test_the_fake_shows_a_lost_gpu_in_both_of_nvmls_shapes() -> None:
    lib = FakeNvml(PRESET)
    lib.nvmlInit()
    lib.set_gpu_lost(3)
    assert lost_code(lambda: lib.nvmlDeviceGetHandleByIndex(3)) == pynvml.NVML_ERROR_GPU_IS_LOST
    lib.set_gpu_lost(5, keep_handle=True)
    handle = lib.nvmlDeviceGetHandleByIndex(5)
    for call in (lambda: lib.nvmlDeviceGetUUID(handle), lambda: lib.nvmlDeviceGetPciInfo(handle),
                 lambda: lib.nvmlDeviceGetMemoryInfo(handle), lambda: lib.nvmlDeviceGetMigMode(handle)):
        assert lost_code(call) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert lib.nvmlDeviceGetCount() == 8
    lib.set_gpu_lost(5, False)
    assert lib.nvmlDeviceGetUUID(handle) == UUIDS[5]
    # Cleared, a lost GPU that kept its handle shows the first shape when lost again without it.
    lib.set_gpu_lost(5)
    assert lost_code(lambda: lib.nvmlDeviceGetHandleByIndex(5)) == pynvml.NVML_ERROR_GPU_IS_LOST


@pytest.mark.parametrize("keep_handle", [False, True], ids=["no-handle", "handle-fails"])
def test_the_inventory_lists_every_gpu_nvml_counts_under_its_nvml_index(keep_handle: bool) -> None:
    fake = FakeNvml(PRESET)
    fake.set_gpu_lost(3, keep_handle=keep_handle)
    backend = fake_backend(fake)
    backend.init()
    inventory = backend.inventory()
    assert [g.index for g in inventory.gpus] == list(range(8))
    assert [g.uuid for g in inventory.gpus] == [*UUIDS[:3], "GPU-lost-nvml-3", *UUIDS[4:]]
    assert [g.lost for g in inventory.gpus] == [False] * 3 + [True] + [False] * 4
    assert [g.pci_bus_id for g in inventory.gpus] == [*BUS_IDS[:3], "", *BUS_IDS[4:]]
    assert inventory.gpus[3].unread and not inventory.gpus[4].unread
    # No link reaches the lost GPU; the others keep theirs (NVSwitch: 18 links each).
    assert {(link.nvlink, link.pcie) for link in inventory.links if 3 in (link.a, link.b)} == {(0, "system")}
    assert {link.nvlink for link in inventory.links if 3 not in (link.a, link.b)} == {18}
    assert backend.health(3).lost and not backend.health(4).lost
    with pytest.raises(MigCallError, match="GPU is lost"):
        MigOps(backend).state(3)
    assert MigOps(backend).state(4).name == "NVIDIA H100 80GB HBM3"

    # It answers again: the next inventory reads it whole, under the same index.
    fake.set_gpu_lost(3, False)
    again = backend.inventory()
    assert [g.uuid for g in again.gpus] == UUIDS
    assert not any(g.lost for g in again.gpus)
    assert {link.nvlink for link in again.links} == {18}


def test_a_gpu_lost_after_it_was_read_keeps_what_was_read_of_it() -> None:
    fake = FakeNvml(PRESET)
    backend = fake_backend(fake)
    backend.init()
    first = backend.inventory()
    fake.set_gpu_lost(6, keep_handle=True)
    later = backend.inventory()
    assert later.gpus[6].lost and not later.gpus[6].unread
    assert (later.gpus[6].uuid, later.gpus[6].pci_bus_id, later.gpus[6].name) == (
        UUIDS[6], BUS_IDS[6], "NVIDIA H100 80GB HBM3")
    assert later.gpus[:6] == first.gpus[:6] and later.gpus[7] == first.gpus[7]


def test_an_earlier_agents_gpus_name_a_gpu_lost_before_this_one_started(tmp_path: Path) -> None:
    earlier = fake_backend(FakeNvml(PRESET))
    earlier.init()
    earlier.inventory()
    assert save_identities(tmp_path / IDENTITY_FILE, earlier.remembered)
    assert not save_identities(tmp_path / IDENTITY_FILE, earlier.remembered)  # unchanged: not written again

    fake = FakeNvml(PRESET)
    fake.set_gpu_lost(2)
    backend = fake_backend(fake)
    backend.remembered.update(load_identities(tmp_path / IDENTITY_FILE))
    backend.init()
    gpu = backend.inventory().gpus[2]
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id, gpu.minor, gpu.memory_mib, gpu.lost) == (
        2, UUIDS[2], BUS_IDS[2], PRESET.gpus[2].minor_number, 81559, True)
    # What was read is kept for the next agent, the lost GPU's identity among it.
    save_identities(tmp_path / IDENTITY_FILE, backend.remembered)
    assert [g["uuid"] for g in json.loads((tmp_path / IDENTITY_FILE).read_text())["gpus"]] == UUIDS


@pytest.mark.parametrize(("content", "why"), [
    ("{", "not the agent's GPU file (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ('{"format": 2, "gpus": []}', "not the agent's GPU file (1 problem(s), first format: Input should be less "
                                  "than or equal to 1)"),
    ('{"format": 1, "gpus": [{"index": 0}]}', "not the agent's GPU file (7 problem(s), first gpus.0.uuid: Field "
                                              "required)"),
    ("x" * (300 * 1024), "larger than 256 KiB; not read"),
])
def test_a_gpu_file_the_agent_cannot_use_is_one_warning_and_not_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, why: str) -> None:
    (tmp_path / IDENTITY_FILE).write_text(content)
    with caplog.at_level(logging.WARNING):
        assert load_identities(tmp_path / IDENTITY_FILE) == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"the GPUs an earlier agent read are not used: {tmp_path / IDENTITY_FILE}: {why}"]


def test_a_gpu_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    os.mkfifo(tmp_path / IDENTITY_FILE)
    with caplog.at_level(logging.WARNING):
        assert load_identities(tmp_path / IDENTITY_FILE) == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"the GPUs an earlier agent read are not used: {tmp_path / IDENTITY_FILE}: is a FIFO, not a regular file"]


def test_fault_lost_handle_reaches_the_running_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "mock-nvml.json"
    agent = FakeNvml(PRESET, state)
    agent.nvmlInit()
    args = ["fault", "--nvml", "mock:dgx-h100", "--mock-state", str(state)]
    assert main([*args, "lost-handle", "3"]) == 0
    assert capsys.readouterr().out == f"GPU 3: lost-handle written to {state}\n"
    handle = agent.nvmlDeviceGetHandleByIndex(3)
    assert lost_code(lambda: agent.nvmlDeviceGetUUID(handle)) == pynvml.NVML_ERROR_GPU_IS_LOST

    # inspect reads the node all the same: the lost GPU under its index, the others as they are.
    assert main(["inspect", "--nvml", "mock:dgx-h100", "--mock-state", str(state), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert [(g["index"], g["uuid"], g["lost"]) for g in view["gpus"]] == [
        (i, "GPU-lost-nvml-3" if i == 3 else UUIDS[i], i == 3) for i in range(8)]
    assert [h["lost"] for h in view["health"]] == [i == 3 for i in range(8)]

    assert main([*args, "clear", "3"]) == 0
    assert agent.nvmlDeviceGetUUID(handle) == UUIDS[3]
