"""The labels of MIG resources belong to the agent: when the MIG layout changes, the old profiles' labels go."""

from __future__ import annotations

from agent.kube.reconciler import label_diff
from agent.labels import owned


def test_mig_resource_labels_are_owned() -> None:
    assert owned("nvidia.com/mig-1g.10gb.count")
    assert owned("nvidia.com/mig-3g.40gb.product")
    # The MIG manager's own label and GPU feature discovery's MIG capability are not resource labels.
    assert not owned("nvidia.com/mig.config")
    assert not owned("nvidia.com/migration")


def test_labels_of_a_profile_no_longer_carved_are_removed() -> None:
    current = {
        "kubernetes.io/hostname": "n1",
        "nvidia.com/mig-1g.10gb.count": "7",
        "nvidia.com/mig-1g.10gb.memory": "9984",
        "nvidia.com/mig.config": "all-1g.10gb",
    }
    desired = {"nvidia.com/mig-3g.40gb.count": "2"}
    assert label_diff(current, desired, owned) == {
        "nvidia.com/mig-3g.40gb.count": "2",
        "nvidia.com/mig-1g.10gb.count": None,
        "nvidia.com/mig-1g.10gb.memory": None,
    }
