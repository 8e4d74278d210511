"""Reading a spec file: a regular file of at most ``MAX_SPEC_BYTES``, parsed as YAML or JSON
with no key written twice, and every error one line that quotes nothing of a file that is not
a spec (see ``_spec``)."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from ..._errors import ConfigError
from ..._paths import file_kind, read_bounded
from ..._text import short_repr
from ._fail import _flat, _is_spec, _unquoted
from ._model import MAX_SPEC_BYTES


def load_data(file: Path, source: str) -> object:
    """The document in ``file``, parsed: what ``parse_spec`` checks. ``source`` names the file
    in errors."""
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
    # keys written twice are reported once the document is known to be a spec: a key of
    # another file can be anything (the first line of /etc/shadow is one, to YAML)
    duplicates: list[tuple[object, str]] = []
    kind = "JSON" if file.suffix.lower() == ".json" else "YAML"
    if kind == "JSON":

        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, value in items:
                if key in out:
                    duplicates.append((key, ""))
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
        loader: _UniqueKeyLoader | None = None
        try:
            loader = _UniqueKeyLoader(text)  # its reader refuses control characters at once
            data = loader.get_single_data()
            duplicates = loader.duplicates
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
    if duplicates and _is_spec(data):
        key, where = duplicates[0]
        raise ConfigError(
            f"{source}: not valid {kind}: duplicate key {short_repr(key)}{where}; each key may "
            "appear once in a mapping"
        )
    return data


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


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``, except that a key written twice in one mapping is recorded in
    ``duplicates`` (YAML says keys are unique; PyYAML keeps the last). Keys brought in by a
    merge (``<<: *base``) may still be overridden: only the keys written in the mapping itself
    are compared."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[object, str]] = []

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: SafeLoader says so itself
                    continue
                if duplicate:
                    self.duplicates.append((key, _at(key_node.start_mark)))
                seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[arg-type]
