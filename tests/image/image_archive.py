"""The agent's images as hack/image.sh leaves them in .cache/cluster/images/: OCI archives read in place (the
image index, each platform's manifest and config), and a platform's root filesystem unpacked from its layers."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = Path(os.environ.get("CLUSTER_CACHE_DIR", REPO / ".cache" / "cluster")) / "images"
# Each platform's root filesystem, unpacked once per image (ROOTFS/<os>-<arch>, with the manifest digest it was
# unpacked from in ROOTFS/<os>-<arch>.digest) and never written to afterwards: programs run on a read-only view.
ROOTFS = IMAGES.parent / "rootfs"
# Where each run mounts the tmpfs of its writable layer, in its own mount namespace: empty, and never written to.
SCRATCH = ROOTFS / ".scratch"
# The OCI image index of the agent for linux/amd64 and linux/arm64 (`make image`).
INDEX_ARCHIVE = IMAGES / "agent-index.tar"
# The amd64 agent image the single-node cluster loads (hack/cluster/images.sh).
AGENT_ARCHIVE = IMAGES / "agent.tar"

INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
LAYER_MEDIA_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip")

# The ELF header's e_machine for each architecture (the System V ABI's processor supplements).
ELF_MACHINE = {"amd64": 62, "arm64": 183}  # EM_X86_64, EM_AARCH64


def require(archive: Path) -> Path:
    """The archive, or the test fails with one line saying how to make it."""
    if not archive.is_file():
        pytest.fail(f"no image archive at {archive}: build it with `make image` (hack/image.sh)", pytrace=False)
    return archive


@dataclass(frozen=True)
class Image:
    """One platform's image in an archive."""

    platform: str  # os/architecture, as the index records it
    manifest_digest: str
    manifest: dict[str, Any]
    config: dict[str, Any]


class Archive:
    """An OCI image layout in a tar file (what `buildah push ... oci-archive:` writes), read without unpacking."""

    def __init__(self, path: Path) -> None:
        self.path = require(path)
        self.tar = tarfile.open(path)  # noqa: SIM115 - closed by close()

    def close(self) -> None:
        self.tar.close()

    def open_blob(self, digest: str) -> IO[bytes]:
        algorithm, _, hexdigest = digest.partition(":")
        blob = self.tar.extractfile(f"blobs/{algorithm}/{hexdigest}")
        assert blob is not None, f"{self.path}: blob {digest} is not a file"
        return blob

    def json(self, digest: str | None = None) -> dict[str, Any]:
        """index.json, or the JSON blob with that digest."""
        member = self.tar.extractfile("index.json") if digest is None else self.open_blob(digest)
        assert member is not None
        data: dict[str, Any] = json.load(member)
        return data

    def top(self) -> dict[str, Any]:
        """The one descriptor index.json holds."""
        manifests = self.json()["manifests"]
        assert len(manifests) == 1, f"{self.path}: index.json holds {len(manifests)} descriptors, not 1"
        top: dict[str, Any] = manifests[0]
        return top

    def images(self) -> dict[str, Image]:
        """Every image in the archive by its platform: those the image index names, or the one image."""
        top = self.top()
        descriptors = self.json(top["digest"])["manifests"] if top["mediaType"] == INDEX_MEDIA_TYPE else [top]
        found: dict[str, Image] = {}
        for d in descriptors:
            manifest = self.json(d["digest"])
            config = self.json(manifest["config"]["digest"])
            recorded = d.get("platform") or {"os": config["os"], "architecture": config["architecture"]}
            platform = f"{recorded['os']}/{recorded['architecture']}"
            assert platform not in found, f"{self.path}: two images for {platform}"
            found[platform] = Image(platform, d["digest"], manifest, config)
        return found

    def unpack(self, image: Image, root: Path) -> Path:
        """The image's root filesystem in root: its layers applied in order, whiteouts honoured."""
        root.mkdir(parents=True, exist_ok=True)
        for layer in image.manifest["layers"]:
            assert layer["mediaType"] in LAYER_MEDIA_TYPES, f"{self.path}: layer of type {layer['mediaType']}"
            with tarfile.open(fileobj=self.open_blob(layer["digest"]), mode="r|*") as tar:
                for member in tar:
                    apply_member(tar, member, root)
        return root


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def apply_member(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path) -> None:
    """One entry of a layer onto the filesystem below it (the OCI image spec's layer changesets): `.wh.NAME`
    deletes NAME, `.wh..wh..opq` empties its directory, anything else replaces what was at its path, except that
    a directory over a directory keeps the lower one's contents."""
    name = member.name.lstrip("/").removeprefix("./")
    if not name or name == ".":
        return
    parent, _, base = name.rpartition("/")
    target = root / name
    if base == ".wh..wh..opq":
        directory = root / parent
        if directory.is_dir() and not directory.is_symlink():
            for child in directory.iterdir():
                _remove(child)
        return
    if base.startswith(".wh."):
        _remove(root / parent / base.removeprefix(".wh."))
        return
    kept = member.isdir() and target.is_dir() and not target.is_symlink()
    if not kept and (target.is_symlink() or target.exists()):
        _remove(target)
    tar.extract(member, root, set_attrs=True, filter="tar")
    if member.isdir():
        # The tar filter clears the high mode bits; a directory keeps its own (/tmp is sticky).
        target.chmod(stat.S_IMODE(member.mode))


def elf_machine(path: Path) -> int:
    """e_machine of an ELF file (little-endian, at offset 18)."""
    header = path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(header[18:20], "little")


def resolve_in(root: Path, path: str) -> Path:
    """path as a program inside root sees it: every symbolic link followed within root."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved, links = root, 0
    while parts:
        part = parts.pop(0)
        candidate = resolved / part
        if part == "..":
            resolved = resolved.parent if resolved != root else root
        elif candidate.is_symlink():
            links += 1
            assert links <= 40, f"{path}: too many symbolic links in {root}"
            link = os.readlink(candidate)
            if link.startswith("/"):
                resolved = root
            parts = [p for p in link.split("/") if p not in ("", ".")] + parts
        else:
            resolved = candidate
    return resolved


# In a mount namespace of its own, the view of the image a container gets: the unpacked image ($1) under an
# overlay whose upper layer is a tmpfs on the scratch directory ($2), read-only as the DaemonSet keeps the root
# filesystem, with the directories its volumes make writable (/var/lib/gpu-node-agent, /tmp) on tmpfs, a fresh /proc,
# the machine's /dev, and each directory of $4.. bound at its own path; then, chrooted there, the program with the
# image's environment ($3, one VAR=value per line) and nothing else.
IN_ROOT = r"""
set -eu
image=$1 scratch=$2 env=$3
shift 3
mount -t tmpfs tmpfs "$scratch"
mkdir "$scratch/upper" "$scratch/work" "$scratch/root"
mount -t overlay overlay -o "lowerdir=$image,upperdir=$scratch/upper,workdir=$scratch/work" "$scratch/root"
root=$scratch/root
mkdir -p "$root/var/lib/gpu-node-agent"
mount -t tmpfs -o mode=0755 tmpfs "$root/var/lib/gpu-node-agent"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
while [ "$1" != -- ]; do mkdir -p "$root$1"; mount --bind "$1" "$root$1"; shift; done
shift
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -o remount,ro "$root"
IFS='
'
exec chroot "$root" /usr/bin/env -i $env "$@"
"""


class Rooted:
    """An image's root filesystem and how to run its programs as its container would."""

    def __init__(self, root: Path, image: Image) -> None:
        self.root = root
        self.image = image
        config = image.config["config"]
        self.env = "\n".join(config["Env"])
        self.entrypoint: list[str] = config["Entrypoint"]

    def argv(self, *program: str, bind: tuple[str, ...] = ()) -> list[str]:
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", IN_ROOT, "sh", str(self.root),
                str(SCRATCH), self.env, *bind, "--", *program]

    def run(self, *program: str, timeout: float = 120) -> str:
        done = subprocess.run(self.argv(*program), capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(program)} in the {self.image.platform} image failed:\n{done.stderr}"
        return done.stdout

    def agent(self, *args: str, timeout: float = 120) -> str:
        return self.run(*self.entrypoint, *args, timeout=timeout)

    def plugin(self, preset: str) -> list[str]:
        """The image's agent on a simulated node as the kubelet harness runs a plugin, {dir} its socket directory."""
        return self.argv(*self.entrypoint, "run", "--nvml", f"mock:{preset}", "--kubelet-dir", "{dir}", "--no-kube",
                         "--metrics-port", "0", bind=("{dir}",))


def unpacked(archive: Archive, platform: str) -> Rooted:
    """The archive's image for platform, unpacked in ROOTFS unless it already is."""
    images = archive.images()
    if platform not in images:
        pytest.fail(f"{archive.path} has no {platform} image (it has {', '.join(images)})", pytrace=False)
    image = images[platform]
    root = ROOTFS / platform.replace("/", "-")
    digest = root.with_name(root.name + ".digest")
    SCRATCH.mkdir(parents=True, exist_ok=True)
    with (ROOTFS / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (digest.is_file() and digest.read_text() == image.manifest_digest and root.is_dir()):
            digest.unlink(missing_ok=True)
            partial = root.with_name(root.name + ".partial")
            for old in (root, partial):
                if old.exists():
                    shutil.rmtree(old)
            archive.unpack(image, partial)
            partial.rename(root)
            digest.write_text(image.manifest_digest)
    return Rooted(root, image)
