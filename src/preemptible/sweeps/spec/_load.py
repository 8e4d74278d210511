"""Reading a spec file: a regular file of at most ``MAX_SPEC_BYTES``, parsed as YAML or JSON,
and every error one line that quotes nothing of a file that is not a spec (see ``_spec``).

Two things W&B's CLI accepts (it reads the file with PyYAML) are accepted here with a warning
naming the key and the line, because people write them and run them with W&B: a key written
twice in one mapping (the last wins, as in PyYAML), and a number such as ``1e-6`` that YAML
1.2 reads as a number but YAML 1.1, PyYAML's, reads as text (it wants a dot and a signed
exponent: ``1.0e-6``); here it is the number it spells. Both are found on the composed YAML
nodes, before anything is constructed, where the lines are still known."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from ..._errors import ConfigError
from ..._paths import file_kind, read_bounded
from ..._text import short_repr
from ._fail import _flat, _is_spec, _key, _unquoted
from ._model import MAX_SPEC_BYTES

# YAML 1.2's numbers with an exponent; YAML 1.1 reads those without a dot or a signed exponent
# (1e-6, 1.5e5) as text
_EXPONENT_NUMBER = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+")
_STR = "tag:yaml.org,2002:str"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"


def load_data(file: Path, source: str) -> tuple[object, list[str]]:
    """The document in ``file``, parsed: what ``parse_spec`` checks, and the warnings about
    how it was read (only for a document that is a spec). ``source`` names the file in
    errors."""
    try:
        text = _read(file, source).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory; give the spec file (YAML or JSON)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: is not UTF-8 text; a spec is YAML or JSON") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read ({exc.strerror or exc})") from None
    data: object
    # warnings are given once the document is known to be a spec: a key of another file can
    # be anything (the first line of /etc/shadow is one, to YAML)
    warnings: list[str] = []
    if file.suffix.lower() == ".json":

        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, value in items:
                if key in out:
                    warnings.append(
                        f"key {short_repr(key)} is written twice in one mapping; the last is used"
                    )
                out[key] = value
            return out

        try:
            data = json.loads(text, object_pairs_hook=pairs)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{source}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
            ) from None
        except (ValueError, RecursionError) as exc:
            raise ConfigError(
                f"{source}: not usable JSON: {_flat(str(exc) or 'nested too deeply')}"
            ) from None
    else:
        loader: yaml.SafeLoader | None = None
        try:
            loader = yaml.SafeLoader(text)  # its reader refuses control characters at once
            node = loader.get_single_node()
            data = None
            if node is not None:
                warnings = _read_as_wandb(node)
                data = loader.construct_document(node)
        except yaml.MarkedYAMLError as exc:
            problem = _unquoted(exc.problem or exc.context or "syntax error")
            where = _at(exc.problem_mark)
            raise ConfigError(f"{source}: not valid YAML: {problem}{where}") from None
        except yaml.reader.ReaderError as exc:  # a control character, an invalid code point
            raise ConfigError(
                f"{source}: not valid YAML: {exc.reason} (character {exc.position + 1})"
            ) from None
        except (yaml.YAMLError, ValueError) as exc:
            raise ConfigError(
                f"{source}: not valid YAML: {_unquoted(str(exc)) or 'a value it cannot read'}"
            ) from None
        except RecursionError:
            raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
        finally:
            if loader is not None:
                loader.dispose()
    if data is None:
        raise ConfigError(f"{source}: is empty; a spec needs at least method and parameters")
    return data, warnings if _is_spec(data) else []


def _at(mark: yaml.Mark | None) -> str:
    return "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"


def _read(file: Path, source: str) -> bytes:
    """The bytes of a spec file: a regular file only (a FIFO would wait for a writer forever,
    a device such as /dev/zero never ends), and at most ``MAX_SPEC_BYTES``."""
    try:
        data = read_bounded(file, MAX_SPEC_BYTES)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        try:  # what it is, for the message: read_bounded refuses all but a regular file
            mode = os.stat(file).st_mode
        except OSError:
            raise exc from None
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(file)) from None
        if stat.S_ISREG(mode):
            raise
        raise ConfigError(
            f"{source}: is not a regular file ({file_kind(mode)}); give the spec file "
            "(YAML or JSON)"
        ) from None
    if len(data) > MAX_SPEC_BYTES:
        raise ConfigError(
            f"{source}: is larger than 1 MiB; a spec is at most {MAX_SPEC_BYTES} bytes"
        )
    return data


def _read_as_wandb(root: yaml.Node) -> list[str]:
    """Warnings for the keys written twice and the numbers YAML 1.1 reads as text under
    ``root``; the tags of those numbers are changed to float, so that they are constructed as
    the numbers they spell. Each node is visited once: an alias is the node it names, so a
    file of aliases that expands enormously is walked in the time of its text."""
    warnings: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if node.tag == _STR and node.style is None and _EXPONENT_NUMBER.fullmatch(node.value):
                node.tag = _FLOAT
                warnings.append(
                    f"{path or '(top level)'}: line {node.start_mark.line + 1}: {node.value} "
                    f"is text to YAML 1.1 (PyYAML, W&B); taken as the number {float(node.value)!r}"
                )
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(
                (item, f"{path}[{i}]") for i, item in reversed(list(enumerate(node.value)))
            )
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            children = []
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:  # its keys may be overridden: not compared
                    children.append((value_node, path))
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    continue  # a list or a mapping as a key: refused when the spec is checked
                line = key_node.start_mark.line + 1
                name = _key(key_node.value)
                earlier = first.get((key_node.tag, key_node.value))
                if earlier is None:
                    first[key_node.tag, key_node.value] = line
                else:
                    lines = (
                        f"on line {line}" if earlier == line else f"on lines {earlier} and {line}"
                    )
                    warnings.append(
                        f"{path or '(top level)'}: key {short_repr(key_node.value)} is written "
                        f"twice {lines}; the last is used, as PyYAML (and so W&B) reads it"
                    )
                children.append((value_node, f"{path}.{name}" if path else name))
            stack.extend(reversed(children))
    return warnings
