"""Database URLs with their secrets hidden, and driver messages scrubbed of them.

``redact_url`` is what every message shows of a URL: the password and whatever follows a
``password=``-like parameter become ``***``. A driver's own message may still quote the URL or
a piece of it (libpq splits a URL otherwise than its writer meant when a password holds an
unencoded ``&`` or a space), so ``Scrubber`` replaces the URL by its redacted form, then each
secret ``url_secrets`` finds: the password as written, %-decoded and %-encoded, the value of a
secret parameter, and the pieces of those between separators. Only whole occurrences are
replaced, never a secret inside a longer word, and never one shorter than ``MIN_SECRET``
characters: "permission denied" stays readable whatever the password is.
"""

from __future__ import annotations

import re
from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlsplit

# A parameter whose %-decoded name matches this holds a secret (password=, sslpassword=, a
# token); passfile= names a file, which is fine to show.
_SECRET_KEY = re.compile(r"pass|secret|token", re.IGNORECASE)
_PUBLIC_KEYS = ("passfile",)
# ``key=`` or ``key =`` at the start, after a URL's ``?``/``&``/``;`` or after white space
_KEY = re.compile(r"(?:^|(?<=[?&;\s]))([^\s=?&;]+)\s*=")
_PLAIN_USER = re.compile(r"[^/?#@\[\]=&;\s]*")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_PIECES = re.compile(r"[/?#@:&=;,'\"\s]+")
# A secret shorter than this (a whole one or a piece) is not scrubbed: replacing two letters
# wherever they stand mangles every message ("permi***ion denied") and points at the password.
MIN_SECRET = 3


def _secret_key(name: str) -> bool:
    key = unquote(name).strip().lower()
    return key not in _PUBLIC_KEYS and bool(_SECRET_KEY.search(key))


def _first_secret_key(text: str) -> re.Match[str] | None:
    for match in _KEY.finditer(text):
        if _secret_key(match.group(1)):
            return match
    return None


def _split_userinfo(url: str) -> tuple[str, str | None, str]:
    """(head, userinfo, rest): the user part is everything between ``://`` (or a bare
    ``scheme:``) and the LAST ``@``, whatever it contains: a password with an unencoded
    ``/``, ``?``, ``#`` or ``@`` is still taken for one. None when there is no ``@``."""
    if "://" in url:
        scheme, body = url.split("://", 1)
        head = f"{scheme}://"
    else:
        match = _SCHEME.match(url)
        split = match.end() + 1 if match and url[match.end() : match.end() + 1] == ":" else 0
        head, body = url[:split], url[split:]
    at = body.rfind("@")
    if at < 0:
        return head, None, body
    return head, body[:at], body[at + 1 :]


def redact_url(url: str) -> str:
    """``url`` with every secret hidden: the password (whatever lies between the ``:`` after
    the user name and the LAST ``@``; all of it when the user name is not plain) and all that
    follows a ``password=``, ``sslpassword=`` or similar parameter (URL query or libpq
    ``key=value`` text: a value with an unencoded ``&`` or space may run on). The rest as
    written; a URL that does not parse at all is shown as its scheme only."""
    if "://" in url:
        scheme = url.split("://", 1)[0]
        try:
            urlsplit(url)
        except ValueError:  # unparsable: show none of it
            return f"{scheme if _SCHEME.fullmatch(scheme) else '***'}://***"
    spans: list[tuple[int, int]] = []  # [start, end) of ``url`` shown as ***
    head, userinfo, _ = _split_userinfo(url)
    if userinfo is not None:
        start, end = len(head), len(head) + len(userinfo)
        user, colon, _ = userinfo.partition(":")
        if _PLAIN_USER.fullmatch(user):
            start += len(user) + len(colon)
        if colon or start < end:
            spans.append((start, end))
    match = _first_secret_key(url)
    if match is not None:
        spans.append((match.end(), len(url)))
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    shown: list[str] = []
    at = 0
    for start, end in merged:
        shown += [url[at:start], "***"]
        at = end
    shown.append(url[at:])
    return "".join(shown)


def userinfo_problem(url: str) -> str | None:
    """Why a postgresql:// URL cannot mean what its writer meant (one line), or None: a user
    or password with an unencoded ``@``, ``/``, ``?`` or ``#`` is split elsewhere by libpq,
    which would then quote pieces of the password in its errors."""
    _, userinfo, _ = _split_userinfo(url)
    found = [c for c in "@/?#" if userinfo is not None and c in userinfo]
    if not found:
        return None
    chars = " and ".join(f"'{c}'" for c in found)
    codes = " and ".join(f"%{ord(c):02X}" for c in found)
    return (
        f"the user or password contains {chars}; write {'it' if len(found) == 1 else 'them'} "
        f"as {codes} (all up to the last '@' is read as the user and password)"
    )


def url_secrets(url: str) -> list[str]:
    """Every secret of ``url`` worth scrubbing, longest first: the password and each secret
    parameter's value (to the end of the text, and to the next separator), each as written,
    %-decoded and %-encoded, and their pieces between separators (a driver may quote a piece
    it read as something else), all at least ``MIN_SECRET`` characters long."""
    regions: list[str] = []
    _, userinfo, _ = _split_userinfo(url)
    if userinfo is not None and ":" in userinfo:
        regions.append(userinfo.split(":", 1)[1])
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        regions.append(password)
    for match in _KEY.finditer(url):
        if _secret_key(match.group(1)):
            tail = url[match.end() :].lstrip()
            regions.append(tail)
            regions.append(re.split(r"[&;\s]", tail, maxsplit=1)[0])
            # to the next "&" only, libpq's one separator of a URL's parameters: it quotes a
            # value with an unencoded space whole ('unexpected spaces found in "Q;x Z"')
            regions.append(tail.split("&", 1)[0])
            if tail[:1] in ("'", '"'):  # libpq's quoted value: 'it''s' or 'it\'s'
                regions.append(tail[1:].split(tail[0], 1)[0])
    found: set[str] = set()
    for region in regions:
        for form in {region, unquote(region), unquote_plus(region)}:
            found.update((form, quote(form, safe=""), quote_plus(form, safe="")))
            found.update(_PIECES.split(form))
    return sorted((s for s in found if len(s) >= MIN_SECRET), key=lambda s: (-len(s), s))


class Scrubber:
    """Hides ``url``'s secrets in a text (a driver's message): the URL itself becomes
    ``display``, then each whole occurrence of a secret becomes ``***``; a secret inside a
    longer word (letters, digits, ``_``) is left alone."""

    def __init__(self, url: str, display: str) -> None:
        self._url = url
        self._display = display
        found = url_secrets(url)
        self._pattern = (
            re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, found)) + r")(?!\w)")
            if found
            else None
        )

    def __call__(self, text: str) -> str:
        text = text.replace(self._url, self._display)
        if self._pattern is None:
            return text
        return self._pattern.sub("***", text)
