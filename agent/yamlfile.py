"""Reads the YAML of every input file the same way: keys unique per mapping, and any failure of the YAML
library turned into one line, so no input can crash a parser; and writes the agent's own state files atomically."""

from __future__ import annotations

import contextlib
import os
import reprlib
import stat
import tempfile
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

import yaml

MAX_INT_BITS = 4000
"""Numbers in config and layout files are small; a larger one is refused rather than carried around."""

MAX_ALIASES = 1000
"""The most alias references (`*name`) one document may hold. The agent's files need none; the shipped layouts
and NVIDIA's published config and mig-parted files use a few anchors at most."""

MAX_ALIASED_VALUES = 100_000
"""The most values the aliases of one document may stand for, counted with every alias expanded (an alias of a
list of 9 values counts 10, an alias of a list of such aliases counts them all). A config, layout or node file
that reuses a part by an alias counts tens; a few hundred bytes of nested aliases ("billion laughs") count
hundreds of millions, and are refused before anything is built from them."""

MAX_DEPTH = 64
"""The deepest nesting of values a document may have: the agent's files nest a few levels (a config about 8),
and a parse that goes on to Python's recursion limit costs most of a second before it fails."""

MAX_SHOWN = 60
"""The most characters of one value of the user's input that an error message quotes."""

MAX_PROBLEMS = 10
"""The most problems of one file an error lists, one line each; a last line counts the rest."""


def printable(text: str) -> str:
    """`text` with every character that is not printable (a control character, a bidi override, a line
    separator, a lone surrogate) written as its escape, so that a message quoting the user's input stays one
    line that shows what it says."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def problem_lines(lines: Iterable[str]) -> str:
    """One line per problem, at most MAX_PROBLEMS of them, then one line saying how many more there are: a file
    with ten thousand mistakes is refused in a few lines, not ten thousand."""
    shown_lines: list[str] = []
    more = 0
    for line in lines:
        if len(shown_lines) < MAX_PROBLEMS:
            shown_lines.append(line)
        else:
            more += 1
    if more:
        shown_lines.append(f"... and {more} more problem{'s' if more > 1 else ''}")
    return "\n".join(shown_lines)


def one_line(text: str, most: int = 2) -> str:
    """An error of one or more lines (one per problem) as one line, for where a single line goes (a node
    annotation, the `mig` command's refusal): its first `most` problems joined by "; ", then how many more."""
    lines = [line for line in text.split("\n") if line and not line.startswith("... and ")]
    more = len(lines) - most
    counted = text.rsplit("\n... and ", 1)
    if len(counted) == 2:  # problem_lines already left some out: count them too
        more += int(counted[1].split()[0])
    return "; ".join(lines[:most]) + (f"; and {more} more problem{'s' if more > 1 else ''}" if more > 0 else "")


class FileProblems(ValueError):
    """An input file that cannot be used: one line per problem, each naming the file, the key path and why (at
    most MAX_PROBLEMS lines, then a count of the rest)."""

    def __init__(self, origin: str, problems: Iterable[tuple[str, str]]) -> None:
        self.origin = origin
        self.problems = list(problems)
        self.lines = [printable(": ".join(part for part in (origin, path, reason) if part))
                      for path, reason in self.problems]
        super().__init__(problem_lines(self.lines))


class YamlProblem(ValueError):
    """The text is not YAML the agent can use; the message is one line."""


class InputFileError(ValueError):
    """An input file that cannot be read as text; the message is one line naming the file and the reason."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


MAX_INPUT_BYTES = 64 * 1024
"""The largest config, layout, node or kubeconfig file the agent reads: sixteen times NVIDIA's largest published
MIG layout file, and small enough that reading any file up to it costs at most 20 MB of memory and 1 s of CPU
(measured by bench/input_cost.py over a hostile corpus: YAML parsed in Python costs about 5 us and 100 bytes
of memory per byte in the worst shapes)."""


def size_text(size: int) -> str:
    """A size limit as a message says it: 64 KiB, 1 MiB, 100 bytes."""
    if size % (1024 * 1024) == 0:
        return f"{size // (1024 * 1024)} MiB"
    return f"{size // 1024} KiB" if size % 1024 == 0 else f"{size} bytes"


def read_file_bytes(path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes, at most `max_bytes` of them: the one way the agent reads a file. A FIFO, a device,
    a socket or a directory is refused before anything is read (opened with O_NONBLOCK, so that opening a FIFO
    does not wait for a writer), and a file larger than `max_bytes` is refused without being read where its size
    can be told from the file system (a file with blocks on disk), else once `max_bytes` + 1 bytes have been read
    (a /proc or sysfs file gives its size as 0 or a page): no input can hang the agent or fill its memory.
    InputFileError, one line naming the file, for each problem (a missing file too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputFileError(path, "no such file") from None
    except OSError as err:
        raise InputFileError(path, f"cannot open: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise InputFileError(path, f"is {kind}, not a regular file")
        if st.st_size > max_bytes and st.st_blocks > 0:
            raise InputFileError(path, f"larger than {size_text(max_bytes)}; not read")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise InputFileError(path, f"cannot read: {err.strerror}") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise InputFileError(path, f"larger than {size_text(max_bytes)}; not read")
    return b"".join(chunks)


def read_text_file(path: Path, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """A regular file's text, read as every input file of the agent is (`read_file_bytes`): at most `max_bytes`,
    UTF-8; each problem is one line naming the file (InputFileError)."""
    data = read_file_bytes(path, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise InputFileError(path, f"not UTF-8 text (byte 0x{data[err.start]:02x} at line {line})") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that rejects a key repeated within one mapping, instead of keeping the last, refuses values
    nested deeper than MAX_DEPTH, and counts the aliases it composes (refusing more than MAX_ALIASES), so that
    their expansion is measured before any value is constructed (see _check_aliases)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases: list[tuple[yaml.Node, yaml.error.Mark]] = []
        """Each alias composed so far: the node it refers to, and where the alias is."""
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        alias = self.check_event(yaml.AliasEvent)
        event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in the library's stubs
        if self.depth == MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep",
                                              event.start_mark)
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if alias and node is not None:
            if len(self.aliases) == MAX_ALIASES:
                raise yaml.composer.ComposerError(None, None, f"more than {MAX_ALIASES} aliases", event.start_mark)
            self.aliases.append((node, event.start_mark))
        return node


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, Hashable):
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def listing(names: Iterable[str], limit: int = 40) -> str:
    """Names for an error message: at most `limit` of them, then how many more, so that an error about a huge
    file stays one short line (it may end up in a Node annotation)."""
    items = list(names)
    shown = ", ".join(items[:limit]) or "none"
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def clip(text: str, limit: int = MAX_SHOWN) -> str:
    """Text from the user's input (a key, a name, a message quoting one) for an error message: whole when it is
    short, else its first `limit` characters, "..." and its length; characters that are not printable escaped."""
    return printable(text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)")


class _ShortRepr(reprlib.Repr):
    """repr() that looks at a few levels and items only, so its cost does not grow with the value."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlong, self.maxother = 3, 6, MAX_SHOWN, MAX_SHOWN
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 10
        self.maxstring = MAX_SHOWN

    def repr_bytes(self, value: bytes, level: int) -> str:
        return repr(value) if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]!r}..."


_SHORT = _ShortRepr()


def shown(value: object) -> str:
    """A value of the user's input as an error message quotes it: repr() when that is short, else the start of
    it, "..." and its size, built without ever making the whole repr (a value can stand for millions)."""
    if isinstance(value, str | bytes):
        unit = "characters" if isinstance(value, str) else "bytes"
        return repr(value) if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]!r}... ({len(value)} {unit})"
    text = _SHORT.repr(value)
    cut = len(text) > MAX_SHOWN
    if cut:
        text = text[:MAX_SHOWN] + "..."
    if isinstance(value, list | tuple | set | frozenset | dict) and (cut or len(value) > _SHORT.maxlist):
        text += f" ({len(value)} items)"
    return text


def _too_large(data: Any) -> bool:
    pending, seen = [data], set()
    while pending:
        item = pending.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if item.bit_length() > MAX_INT_BITS:
                return True
        elif isinstance(item, dict | list) and id(item) not in seen:
            seen.add(id(item))
            pending.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)
    return False


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_aliases(aliases: list[tuple[yaml.Node, yaml.error.Mark]]) -> None:
    """Refuse a document whose aliases stand for more than MAX_ALIASED_VALUES values, or whose alias refers to a
    value that contains it, from the composed nodes alone (each node is counted once, however many aliases reach
    it), so that no expansion is ever built."""
    sizes: dict[int, int] = {}
    """Values under a node, itself included, with aliases expanded; by node id."""
    total = 0
    for target, mark in aliases:
        stack: list[tuple[yaml.Node, bool]] = [(target, False)]
        entered: set[int] = set()
        while stack:
            node, done = stack.pop()
            if done:
                sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
                entered.discard(id(node))
            elif id(node) in entered:
                raise yaml.composer.ComposerError(None, None, "an alias refers to a value that contains it", mark)
            elif id(node) not in sizes:
                entered.add(id(node))
                stack.append((node, True))
                stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
        total += sizes[id(target)]
        if total > MAX_ALIASED_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"aliases expand to more than {MAX_ALIASED_VALUES} values", mark)


def _parse(text: str) -> Any:
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_aliases(loader.aliases)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml(text: str) -> Any:
    """The document in `text`; YamlProblem naming the line and column where the YAML library can. Aliases are
    bounded (MAX_ALIASES, MAX_ALIASED_VALUES) before the document is built."""
    try:
        data = _parse(text)
    except RecursionError:
        raise YamlProblem("invalid YAML: nested too deeply") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise YamlProblem(f"invalid YAML: {' '.join(str(err.problem).split())}{where}") from None
    except Exception as err:  # the library's constructors raise plain ValueError, TypeError and more on odd tags
        raise YamlProblem("invalid YAML: " + " ".join(f"{type(err).__name__}: {err}".split())) from None
    if _too_large(data):
        raise YamlProblem(f"a number is larger than {MAX_INT_BITS} bits")
    return data


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader, or the agent after a crash, sees the old file or the new one,
    never a part: written to a temporary file beside it, flushed to disk, renamed over it, and the directory
    flushed too, so that the rename itself survives a power loss."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """Flush a directory's entries to disk (after a rename or an unlink in it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
