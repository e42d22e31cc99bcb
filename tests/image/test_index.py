"""The agent's multi-arch image (`make image`): one OCI image index with an image for linux/amd64 and one for
linux/arm64, each built for its architecture from the same Dockerfile, the amd64 one being the image the
single-node cluster runs."""

from __future__ import annotations

from image_archive import INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, Archive

PLATFORMS = ["linux/amd64", "linux/arm64"]


def test_the_archive_holds_one_image_index_naming_both_platforms(index_archive: Archive) -> None:
    top = index_archive.top()
    assert top["mediaType"] == INDEX_MEDIA_TYPE
    index = index_archive.json(top["digest"])
    assert index["mediaType"] == INDEX_MEDIA_TYPE
    recorded = [(m["mediaType"], m["platform"]["os"], m["platform"]["architecture"]) for m in index["manifests"]]
    assert sorted(recorded) == [(MANIFEST_MEDIA_TYPE, "linux", "amd64"), (MANIFEST_MEDIA_TYPE, "linux", "arm64")]


def test_each_image_s_config_says_the_platform_the_index_files_it_under(index_archive: Archive) -> None:
    images = index_archive.images()
    assert sorted(images) == PLATFORMS
    assert {p: (i.config["os"], i.config["architecture"]) for p, i in images.items()} == {
        "linux/amd64": ("linux", "amd64"),
        "linux/arm64": ("linux", "arm64"),
    }


def test_both_images_run_the_agent_as_the_dockerfile_says(index_archive: Archive) -> None:
    # The Dockerfile's ENTRYPOINT, CMD, USER, EXPOSE and LABELs, the same on both.
    for image in index_archive.images().values():
        config = image.config["config"]
        assert (config["Entrypoint"], config["Cmd"], config["User"], sorted(config["ExposedPorts"])) == (
            ["gpu-agent"], ["run"], "0:0", ["9400/tcp"]
        ), image.platform
        assert config["Labels"]["org.opencontainers.image.title"] == "gpu-node-agent", image.platform
        assert config["Labels"]["org.opencontainers.image.version"] == "0.1.0", image.platform


def test_the_amd64_image_is_the_one_the_cluster_runs(index_archive: Archive, agent_archive: Archive) -> None:
    # agent.tar, loaded by hack/cluster/up.sh, holds one image: the index's linux/amd64 image, config for config.
    cluster = agent_archive.images()
    assert list(cluster) == ["linux/amd64"]
    in_index = index_archive.images()["linux/amd64"]
    assert cluster["linux/amd64"].manifest["config"]["digest"] == in_index.manifest["config"]["digest"]
