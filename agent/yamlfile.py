"""Reads the YAML of every input file the same way: keys unique per mapping, and any failure of the YAML
library turned into one line, so no input can crash a parser."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import yaml

MAX_INT_BITS = 4000
"""Numbers in config and layout files are small; a larger one is refused rather than carried around."""


class FileProblems(ValueError):
    """An input file that cannot be used: one line per problem, each naming the file, the key path and why."""

    def __init__(self, origin: str, problems: Iterable[tuple[str, str]]) -> None:
        self.origin = origin
        self.problems = list(problems)
        self.lines = [": ".join(part for part in (origin, path, reason) if part) for path, reason in self.problems]
        super().__init__("\n".join(self.lines))


class YamlProblem(ValueError):
    """The text is not YAML the agent can use; the message is one line."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that rejects a key repeated within one mapping, instead of keeping the last."""


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


def load_yaml(text: str) -> Any:
    """The document in `text`; YamlProblem naming the line and column where the YAML library can."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
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
