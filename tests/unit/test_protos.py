"""The committed stubs match protos/, and protos/ matches the kubelet's wire contract."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent.deviceplugin.v1beta1 import api_pb2

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [
    f"agent/{package}/{name}"
    for package in ("deviceplugin/v1beta1", "podresources_v1", "dra/v1", "dra/v1beta1", "dra/pluginregistration",
                    "dra/health_v1alpha1", "dra/health_v1")
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py", "api_pb2_grpc.pyi")
]

# (message, field) -> (number, type name) as the kubelet's v1beta1 API defines them.
WIRE = {
    ("DevicePluginOptions", "pre_start_required"): (1, "bool"),
    ("DevicePluginOptions", "get_preferred_allocation_available"): (2, "bool"),
    ("RegisterRequest", "version"): (1, "string"),
    ("RegisterRequest", "endpoint"): (2, "string"),
    ("RegisterRequest", "resource_name"): (3, "string"),
    ("RegisterRequest", "options"): (4, "DevicePluginOptions"),
    ("ListAndWatchResponse", "devices"): (1, "Device"),
    ("TopologyInfo", "nodes"): (1, "NUMANode"),
    ("NUMANode", "ID"): (1, "int64"),
    ("Device", "ID"): (1, "string"),
    ("Device", "health"): (2, "string"),
    ("Device", "topology"): (3, "TopologyInfo"),
    ("PreStartContainerRequest", "devices_ids"): (1, "string"),
    ("PreferredAllocationRequest", "container_requests"): (1, "ContainerPreferredAllocationRequest"),
    ("ContainerPreferredAllocationRequest", "available_deviceIDs"): (1, "string"),
    ("ContainerPreferredAllocationRequest", "must_include_deviceIDs"): (2, "string"),
    ("ContainerPreferredAllocationRequest", "allocation_size"): (3, "int32"),
    ("PreferredAllocationResponse", "container_responses"): (1, "ContainerPreferredAllocationResponse"),
    ("ContainerPreferredAllocationResponse", "deviceIDs"): (1, "string"),
    ("AllocateRequest", "container_requests"): (1, "ContainerAllocateRequest"),
    ("ContainerAllocateRequest", "devices_ids"): (1, "string"),
    ("AllocateResponse", "container_responses"): (1, "ContainerAllocateResponse"),
    ("ContainerAllocateResponse", "envs"): (1, "EnvsEntry"),
    ("ContainerAllocateResponse", "mounts"): (2, "Mount"),
    ("ContainerAllocateResponse", "devices"): (3, "DeviceSpec"),
    ("ContainerAllocateResponse", "annotations"): (4, "AnnotationsEntry"),
    ("ContainerAllocateResponse", "cdi_devices"): (5, "CDIDevice"),
    ("CDIDevice", "name"): (1, "string"),
    ("Mount", "container_path"): (1, "string"),
    ("Mount", "host_path"): (2, "string"),
    ("Mount", "read_only"): (3, "bool"),
    ("DeviceSpec", "container_path"): (1, "string"),
    ("DeviceSpec", "host_path"): (2, "string"),
    ("DeviceSpec", "permissions"): (3, "string"),
}
SCALARS = {8: "bool", 9: "string", 3: "int64", 5: "int32"}


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run([str(ROOT / "hack/protos.sh"), str(tmp_path)], check=True, capture_output=True)
    stale = [name for name in GENERATED if (tmp_path / name).read_bytes() != (ROOT / name).read_bytes()]
    assert stale == [], f"stale generated stubs (run `make protos`): {stale}"


def test_package_services_and_methods() -> None:
    file = api_pb2.DESCRIPTOR
    assert file.package == "v1beta1"
    methods = {
        f"/{s.full_name}/{m.name}": (m.input_type.name, m.output_type.name, m.server_streaming)
        for s in file.services_by_name.values()
        for m in s.methods
    }
    assert methods == {
        "/v1beta1.Registration/Register": ("RegisterRequest", "Empty", False),
        "/v1beta1.DevicePlugin/GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "/v1beta1.DevicePlugin/ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "/v1beta1.DevicePlugin/GetPreferredAllocation": (
            "PreferredAllocationRequest", "PreferredAllocationResponse", False),
        "/v1beta1.DevicePlugin/Allocate": ("AllocateRequest", "AllocateResponse", False),
        "/v1beta1.DevicePlugin/PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    }


@pytest.mark.parametrize(("message", "field"), sorted(WIRE))
def test_wire_field_numbers(message: str, field: str) -> None:
    descriptor = api_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
    kind = descriptor.message_type.name if descriptor.message_type else SCALARS[descriptor.type]
    assert (descriptor.number, kind) == WIRE[(message, field)]


def test_podresources_wire_contract() -> None:
    from agent.podresources_v1 import api_pb2 as pr

    assert pr.DESCRIPTOR.package == "v1"
    service = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources"]
    fields = {
        (m.name, f.name): f.number for m in pr.DESCRIPTOR.message_types_by_name.values() for f in m.fields
    }
    assert fields == {
        ("AllocatableResourcesResponse", "devices"): 1, ("AllocatableResourcesResponse", "cpu_ids"): 2,
        ("AllocatableResourcesResponse", "memory"): 3, ("ListPodResourcesResponse", "pod_resources"): 1,
        ("PodResources", "name"): 1, ("PodResources", "namespace"): 2, ("PodResources", "containers"): 3,
        ("ContainerResources", "name"): 1, ("ContainerResources", "devices"): 2, ("ContainerResources", "cpu_ids"): 3,
        ("ContainerResources", "memory"): 4, ("ContainerMemory", "memory_type"): 1, ("ContainerMemory", "size"): 2,
        ("ContainerMemory", "topology"): 3, ("ContainerDevices", "resource_name"): 1,
        ("ContainerDevices", "device_ids"): 2, ("ContainerDevices", "topology"): 3, ("TopologyInfo", "nodes"): 1,
        ("NUMANode", "ID"): 1,
    }


def test_every_field_is_covered() -> None:
    fields = {
        (m.name, f.name)
        for m in api_pb2.DESCRIPTOR.message_types_by_name.values()
        for f in m.fields
    }
    assert fields == set(WIRE)


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_dra_wire_contract(version: str) -> None:
    """k8s.io/kubelet/pkg/apis/dra/{v1,v1beta1}/api.proto: the kubelet calls these full method names."""
    import importlib

    dra = importlib.import_module(f"agent.dra.{version}.api_pb2")
    package = f"k8s.io.kubelet.pkg.apis.dra.{version}"
    assert dra.DESCRIPTOR.package == package
    methods = {f"/{s.full_name}/{m.name}": (m.input_type.name, m.output_type.name)
               for s in dra.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert methods == {
        f"/{package}.DRAPlugin/NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
        f"/{package}.DRAPlugin/NodeUnprepareResources": (
            "NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse"),
    }
    fields = {(m.name, f.name): f.number for m in dra.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    expected = {
        ("NodePrepareResourcesRequest", "claims"): 1, ("NodePrepareResourcesResponse", "claims"): 1,
        ("NodePrepareResourceResponse", "devices"): 1, ("NodePrepareResourceResponse", "error"): 2,
        ("Device", "request_names"): 1, ("Device", "pool_name"): 2, ("Device", "device_name"): 3,
        ("Device", "cdi_device_ids"): 4, ("NodeUnprepareResourcesRequest", "claims"): 1,
        ("NodeUnprepareResourcesResponse", "claims"): 1, ("NodeUnprepareResourceResponse", "error"): 1,
        ("Claim", "namespace"): 1, ("Claim", "uid"): 2, ("Claim", "name"): 3,
    }
    if version == "v1":
        expected[("Device", "share_id")] = 5
    assert fields == expected


def test_plugin_registration_wire_contract() -> None:
    """k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto (package "pluginregistration" on the wire)."""
    from agent.dra.pluginregistration import api_pb2 as reg

    assert reg.DESCRIPTOR.package == "pluginregistration"
    service = reg.DESCRIPTOR.services_by_name["Registration"]
    assert [(m.name, m.input_type.name, m.output_type.name) for m in service.methods] == [
        ("GetInfo", "InfoRequest", "PluginInfo"),
        ("NotifyRegistrationStatus", "RegistrationStatus", "RegistrationStatusResponse"),
    ]
    fields = {(m.name, f.name): f.number for m in reg.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    assert fields == {("PluginInfo", "type"): 1, ("PluginInfo", "name"): 2, ("PluginInfo", "endpoint"): 3,
                      ("PluginInfo", "supported_versions"): 4, ("RegistrationStatus", "plugin_registered"): 1,
                      ("RegistrationStatus", "error"): 2}


def test_dra_health_wire_contract() -> None:
    """k8s.io/kubelet/pkg/apis/dra-health/v1alpha1/api.proto (Kubernetes 1.34): the kubelet calls
    /v1alpha1.DRAResourceHealth/NodeWatchResources, a server stream."""
    from agent.dra.health_v1alpha1 import api_pb2 as health

    assert health.DESCRIPTOR.package == "v1alpha1"
    methods = {f"/{s.full_name}/{m.name}": (m.input_type.name, m.output_type.name, m.client_streaming,
                                              m.server_streaming)
               for s in health.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert methods == {"/v1alpha1.DRAResourceHealth/NodeWatchResources": (
        "NodeWatchResourcesRequest", "NodeWatchResourcesResponse", False, True)}
    fields = {(m.name, f.name): (f.number, f.message_type.name if f.message_type else
                                 f.enum_type.name if f.enum_type else SCALARS[f.type])
              for m in health.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    assert fields == {
        ("DeviceIdentifier", "pool_name"): (1, "string"), ("DeviceIdentifier", "device_name"): (2, "string"),
        ("DeviceHealth", "device"): (1, "DeviceIdentifier"), ("DeviceHealth", "health"): (2, "HealthStatus"),
        ("DeviceHealth", "last_updated_time"): (3, "int64"),
        ("NodeWatchResourcesResponse", "devices"): (1, "DeviceHealth"),
    }
    status = health.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in status.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_dra_health_v1_wire_contract() -> None:
    """k8s.io/kubelet/pkg/apis/dra-health/v1/api.proto (Kubernetes 1.37): /v1.DRAResourceHealth/NodeWatchResources,
    v1alpha1's messages with two more fields, so a v1alpha1 response read as v1 keeps every field."""
    from agent.dra.health_v1 import api_pb2 as health
    from agent.dra.health_v1alpha1 import api_pb2 as alpha

    assert health.DESCRIPTOR.package == "v1"
    methods = {f"/{s.full_name}/{m.name}": (m.input_type.name, m.output_type.name, m.client_streaming,
                                              m.server_streaming)
               for s in health.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert methods == {"/v1.DRAResourceHealth/NodeWatchResources": (
        "NodeWatchResourcesRequest", "NodeWatchResourcesResponse", False, True)}
    fields = {(m.name, f.name): (f.number, f.message_type.name if f.message_type else
                                 f.enum_type.name if f.enum_type else SCALARS[f.type])
              for m in health.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    assert fields == {
        ("DeviceIdentifier", "pool_name"): (1, "string"), ("DeviceIdentifier", "device_name"): (2, "string"),
        ("DeviceHealth", "device"): (1, "DeviceIdentifier"), ("DeviceHealth", "health"): (2, "HealthStatus"),
        ("DeviceHealth", "last_updated_time"): (3, "int64"),
        ("DeviceHealth", "health_check_timeout_seconds"): (4, "int64"), ("DeviceHealth", "message"): (5, "string"),
        ("NodeWatchResourcesResponse", "devices"): (1, "DeviceHealth"),
    }
    status = health.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in status.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    sent = alpha.NodeWatchResourcesResponse(devices=[alpha.DeviceHealth(
        device=alpha.DeviceIdentifier(pool_name="node", device_name="gpu-1"), health=alpha.UNHEALTHY,
        last_updated_time=1700000000)])
    read = health.NodeWatchResourcesResponse.FromString(sent.SerializeToString())
    assert [(d.device.pool_name, d.device.device_name, d.health, d.last_updated_time) for d in read.devices] == [
        ("node", "gpu-1", health.UNHEALTHY, 1700000000)]
