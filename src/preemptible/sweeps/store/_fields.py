"""The JSON columns of the sweep queue (a sweep's spec, a run's params and summary), read back.

preemptible writes them with ``json.dumps``, but the database is shared: a hand edit, another
tool or a damaged file can leave text there that is not JSON, JSON that is not an object, or
the NaN and Infinity that JSON has no place for. One such field must not stop anyone: the
readers (``status``, the sweep list) show it as unreadable with one warning naming the run and
the field, a claim fails that one run with the reason (its parameters cannot be run), and only
a sweep whose spec is unreadable cannot be run at all (one clear line).

The reason given never quotes the field's text: it says what is wrong and where (line and
column), nothing of what is there.
"""

from __future__ import annotations

import json
from typing import Any

from ..._errors import UnreadableField
from ..spec._fail import kind_of


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name}, which JSON has no place for")


# One decoder for every field (``json.loads`` with options builds one per call): floats as
# the C scanner reads them (a number too large for a float, ``1e999``, becomes inf, which the
# readers treat as no number), NaN and Infinity refused.
DECODER = json.JSONDecoder(parse_constant=_no_constant)


def decode_object(text: object) -> tuple[dict[str, Any] | None, str | None]:
    """``(value, None)`` for a JSON object (None for SQL NULL), else ``(None, why)``: why in a
    few words, without quoting the text."""
    if text is None:
        return None, None
    if not isinstance(text, str):
        return None, f"not text but {type(text).__name__}"
    try:
        value, end = DECODER.raw_decode(text)
        if end != len(text) and text[end:].strip():
            extra = end + len(text[end:]) - len(text[end:].lstrip())
            raise json.JSONDecodeError("Extra data", text, extra)
    except json.JSONDecodeError as exc:
        if exc.pos == 0 and text[:1].isspace() and text.strip():
            return decode_object(text.strip())  # raw_decode takes no leading white space
        msg = exc.msg.removesuffix(" at")  # "Invalid control character at"
        return None, f"not JSON ({msg} at line {exc.lineno}, column {exc.colno})"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as exc:  # _no_constant, an integer of more than 4300 digits
        reason = str(exc) if "JSON" in str(exc) else "a number too long"
        return None, f"not usable JSON ({reason})"
    if not isinstance(value, dict):
        return None, f"JSON but not an object ({kind_of(value)})"
    return value, None


def field_error(what: str, field: str, why: str) -> UnreadableField:
    """The one line about a field that cannot be read: ``run X: its params in the sweep
    database are not JSON (...)``."""
    verb = "are" if field.endswith("s") else "is"
    shown = (
        what
        if what.isprintable()
        else "".join(c if c.isprintable() else repr(c)[1:-1] for c in what)
    )
    return UnreadableField(f"{shown}: its {field} in the sweep database {verb} {why}")


def strict_object(text: object, what: str, field: str) -> dict[str, Any]:
    """The decoded object; UnreadableField (one line) when the field cannot be read or is NULL."""
    value, why = decode_object(text)
    if why is not None:
        raise field_error(what, field, why)
    if value is None:
        raise field_error(what, field, "missing (NULL)")
    return value
