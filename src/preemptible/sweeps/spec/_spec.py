"""The sweep spec: W&B's sweep configuration where the two overlap, validated in one pass.

A W&B user's spec works unchanged: the same keys, the same distributions (and the same
inference when ``distribution`` is left out: ``values`` -> categorical, ``value`` ->
constant, integer ``min``/``max`` -> int_uniform, otherwise uniform), nested ``parameters``,
the same command macros. The keys W&B documents but preemptible has no use for
(``description``, ``project``, ``entity``, ``early_terminate``, and ``target``/``impute`` in
``metric``) are accepted, kept in ``raw`` and listed in ``SweepSpec.ignored`` so the CLI can
say so; any other key is refused with the list of valid ones, because a typo that silently
does nothing (``run_caps: 10``) costs a night of compute. ``controller: {type: local}`` is
checked as W&B checks it and ignored the same way (the queue is the controller). A value
listed twice in ``values`` is drawn twice as often by random and bayes, and run once by a
grid, as in W&B.

Every problem is one line of the ``ConfigError`` that names the key path, e.g.
``spec.yaml: parameters.lr.distribution: 'lognormal' is not valid; valid: constant, ...``;
all the problems of a file are reported at once, a line each (one per parameter and per
top-level key: the first problem of each). What W&B runs but flags is accepted with a line in
``SweepSpec.warnings``: a number YAML 1.1 reads as text (``1e-6``) is the number it spells, a
key written twice keeps its last value (as PyYAML, which W&B's CLI uses), and the natural-log
distributions (``log_uniform`` with base-e bounds) carry W&B's deprecation warning.
The input is checked to be plain JSON data first (YAML can also give dates, sets and binary),
so that ``raw`` can be stored in the queue and parsed again to the same spec by every agent.

An error never quotes a file that is not a spec: the path given may be any file (a link to
``/etc/shadow``, a key file), so until the document has parsed as a mapping a message names
only the file, the line and column, and what kind of thing was found; a parser's message is
stripped of the text it quotes. Values are quoted only from a document that is a mapping.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ._checks import _parse
from ._fail import _checked, _clean
from ._load import load_data
from ._model import SweepSpec


def load_spec(path: str | os.PathLike[str]) -> SweepSpec:
    """Read a spec from a YAML file (``yaml.safe_load``), or JSON when it ends in .json: a
    regular file of at most 1 MiB. What the file's syntax made doubtful (a key written twice,
    ``1e-6`` read as text) comes first in ``warnings``."""
    source = _clean(str(path))
    data, warnings = load_data(Path(path), source)
    spec = parse_spec(data, source=source)
    return dataclasses.replace(spec, warnings=(*warnings, *spec.warnings))


def parse_spec(data: object, *, source: str = "spec") -> SweepSpec:
    """Validate ``data`` (the loaded YAML/JSON mapping); raise ConfigError with a line per
    problem."""
    spec, warnings = _checked(_parse, data, source)
    return dataclasses.replace(spec, warnings=tuple(warnings)) if warnings else spec
