"""Every relative link in the repository's documentation resolves to a file in the repository, and every anchor to
a heading of that file. A link that leaves the repository fails even when its target exists on this machine: a
clone does not have it. And the two maps a newcomer starts from cover the territory: docs/architecture.md names
every part of the package, tests/README.md every layer of the tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.builders import FENCE, github_anchor

REPO = Path(__file__).resolve().parents[2]

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline link or image, `[text](target "title")`; the target is group 1."""
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
"""A reference definition, `[name]: target`."""
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
EXTERNAL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
"""A link with a scheme (https:, mailto:, ...): not a file of the repository."""


def documents() -> list[Path]:
    """The files whose links a reader follows: the READMEs, SECURITY.md, and every Markdown file under docs/."""
    found = [REPO / name for name in ("README.md", "SECURITY.md", "tests/README.md", "tests/kubelet/README.md")]
    found += sorted((REPO / "docs").rglob("*.md"))
    found += sorted((REPO / "deployments" / "helm").glob("*/README.md"))
    return [p for p in found if p.is_file()]


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    return LINK.findall(body) + REFERENCE.findall(body)


def anchors(path: Path) -> set[str]:
    """The ids GitHub gives the headings of a Markdown file: a repeated heading gets -1, -2, ...; plus any
    explicit <a name/id> anchors."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    ids: set[str] = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(text):
        slug = github_anchor(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", ""))
        count = seen.get(slug, 0)
        ids.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return ids


def broken_links(document: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of `document`, one line each; empty when every link resolves."""
    problems = []
    for link in links(document.read_text()):
        if EXTERNAL.match(link):
            continue
        target, _, fragment = link.partition("#")
        if target.startswith("/"):
            problems.append(f"{link}: an absolute path; link relative to {document.name}")
            continue
        path = (document.parent / target).resolve() if target else document
        if not path.is_relative_to(root.resolve()):
            problems.append(f"{link}: outside the repository (a clone has no {path})")
        elif not path.exists():
            problems.append(f"{link}: no file {path.relative_to(root.resolve())}")
        elif fragment and path.is_file() and path.suffix == ".md" and fragment not in anchors(path):
            problems.append(f"{link}: no heading #{fragment} in {path.relative_to(root.resolve())}")
    return problems


def test_the_documents_include_the_readme_the_guides_and_the_chart() -> None:
    names = {p.relative_to(REPO).as_posix() for p in documents()}
    assert {"README.md", "SECURITY.md", "docs/architecture.md", "docs/operations.md", "tests/README.md",
            "deployments/helm/gpu-node-agent/README.md"} <= names
    assert any(n.startswith("docs/reference/") for n in names)


@pytest.mark.parametrize("document", documents(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(document: Path) -> None:
    assert broken_links(document) == []


def test_the_readme_links_the_design_in_the_repository() -> None:
    readme = links((REPO / "README.md").read_text())
    assert "docs/architecture.md" in readme
    assert "docs/reference/README.md" in readme


def test_broken_links_names_each_kind_of_fault(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (tmp_path / "outside.md").write_text("# Outside\n")
    (repo / "docs" / "other.md").write_text("# Title\n\n## Step `one`\n\n## Step `one`\n")
    doc = repo / "docs" / "guide.md"
    doc.write_text(
        "# Guide\n\n"
        "[ok](other.md) [ok anchor](other.md#step-one) [repeated](other.md#step-one-1) [self](#guide)\n"
        "[web](https://example.com/x.md) [dir](.) ![image](other.md)\n"
        "[missing](nothing.md) [bad anchor](other.md#step-two) [away](../../outside.md) [root](/etc/hosts)\n"
        "[bad self](#nowhere)\n\n"
        "`[code](not-a-link.md)`\n\n"
        "```\n[fenced](not-a-link-either.md)\n```\n\n"
        "[ref]: missing-too.md\n"
    )
    assert broken_links(doc, repo) == [
        "nothing.md: no file docs/nothing.md",
        "other.md#step-two: no heading #step-two in docs/other.md",
        f"../../outside.md: outside the repository (a clone has no {tmp_path.resolve() / 'outside.md'})",
        "/etc/hosts: an absolute path; link relative to guide.md",
        "#nowhere: no heading #nowhere in docs/guide.md",
        "missing-too.md: no file docs/missing-too.md",
    ]


def parts_of_the_package() -> list[str]:
    """Each top-level module and subpackage of agent/, as the design page writes it; generated stubs excluded."""
    parts = []
    for path in sorted((REPO / "agent").iterdir()):
        if path.name.startswith(("_", ".")) or path.name.endswith("_v1"):
            continue
        if path.is_dir() and (path / "__init__.py").is_file():
            parts.append(f"agent/{path.name}/")
        elif path.suffix == ".py":
            parts.append(f"agent/{path.name}")
    return parts


def test_the_design_names_every_part_of_the_package() -> None:
    parts = parts_of_the_package()
    assert {"agent/daemon.py", "agent/state.py", "agent/nvml/", "agent/deviceplugin/", "agent/kube/"} <= set(parts)
    design = (REPO / "docs" / "architecture.md").read_text()
    assert [p for p in parts if f"`{p}`" not in design] == []


def test_the_design_names_every_module_of_each_part() -> None:
    """Each module of a subpackage is named in that subpackage's row of the module table, so that the table says
    where a change goes (generated stubs excluded)."""
    rows = dict(re.findall(r"^\| `(agent/[^`]+/)` \|(.*)$", (REPO / "docs" / "architecture.md").read_text(), re.M))
    missing = []
    for path in sorted((REPO / "agent").glob("*/**/*.py")):
        part, rel = path.relative_to(REPO / "agent").parts[0], "/".join(path.relative_to(REPO / "agent").parts[1:])
        if path.name == "__init__.py" or "_pb2" in path.name or not (REPO / "agent" / part / "__init__.py").is_file():
            continue
        if f"`{rel}`" not in rows.get(f"agent/{part}/", ""):
            missing.append(f"agent/{part}/{rel}")
    assert {"agent/nvml/", "agent/dra/", "agent/topology/"} <= set(rows)
    assert missing == []


def test_the_tests_guide_names_every_layer() -> None:
    layers = sorted(p.name for p in (REPO / "tests").iterdir() if p.is_dir() and any(p.rglob("test_*.py")))
    assert {"unit", "integration", "kubelet", "faults", "fuzz", "e2e"} <= set(layers)
    guide = (REPO / "tests" / "README.md").read_text()
    assert [name for name in layers if f"`{name}/`" not in guide] == []
