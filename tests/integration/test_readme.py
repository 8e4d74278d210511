"""Every code block of README.md and of the docs site (docs/**/*.md) is executed or checked,
so an example cannot drift.

One test per fenced block, named after its page (``README/03-...``,
``frontends/lightning/00-...``); a block that runs a framework's fit is marked
``frameworks`` (its lane in tests/services/lanes.sh). The marker before each block says what
is done with it, and the
harness that does it is tests/support/readme.py (its docstring lists the kinds; its own unit
tests are tests/unit/test_readme_harness.py). Commands named by ``make run=`` and
``output of=`` start in the background when this module starts and their items run last, so
the demo (a sweep: about a minute) overlaps the other items.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.readme import (
    KINDS,
    Block,
    Ctx,
    Parsed,
    commands_of,
    documents,
    needs_framework,
    page_name,
    parse_readme,
    plan,
    start_commands,
    stop_commands,
    timeout_of,
    unique_blocks,
)

PAGES: dict[str, Parsed] = {
    page_name(path): parse_readme(path.read_text(), page_name(path)) for path in documents()
}
# a block repeated word for word on another page (the README's examples) runs once
BLOCKS = unique_blocks([block for parsed in PAGES.values() for block in parsed.blocks])


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.timeout(timeout_of(block))]
    if needs_framework(block):
        marks.append(pytest.mark.frameworks)
    return marks


@pytest.fixture(scope="module", autouse=True)
def background_commands(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Start the commands the selected items compare with (the demo: a minute) at once, so they
    run beside the other items (their items come last); kill what is left at the end."""
    wanted: set[str] = set()
    for item in request.session.items:
        block = getattr(item, "callspec", None) and item.callspec.params.get("block")
        if isinstance(block, Block):
            wanted.update(commands_of(block))
    start_commands(wanted, tmp_path_factory)
    yield
    stop_commands()


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b, id=b.id, marks=_marks(b))
        # the blocks that wait for a background command last
        for b in sorted(BLOCKS, key=lambda b: bool(commands_of(b)))
    ],
)
def test_readme_block(
    block: Block,
    tmp_path: Path,
    spawn: Any,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> None:
    what = plan(block)
    page = PAGES[block.page].blocks
    ctx = Ctx(tmp_path, spawn, tmp_path_factory, page, request.getfixturevalue)
    KINDS[what.kind].run(block, what.options, ctx)


def test_markers_sit_right_before_a_fence() -> None:
    assert PAGES["README.md"].blocks, "no code blocks found in README.md"
    problems = [p for parsed in PAGES.values() for p in parsed.problems]
    assert not problems, "\n".join(problems)


# -- the harness, running blocks (what runs nothing: tests/unit/test_readme_harness.py) -------

GROUPED = """\
<!-- readme-test: python setup=bare group=harness-1 -->
```python
x = 41
```

<!-- readme-test: python setup=bare group=harness-1 -->
```python
assert x + 1 == 42, "the second block sees the first one's names"
```

<!-- readme-test: python setup=bare -->
```python
def drifted():
    raise RuntimeError("an example that no longer works")
drifted()
```
"""


@pytest.mark.timeout(60)
def test_the_harness_runs_a_group_as_one_program_and_names_the_failing_line(
    tmp_path: Path, spawn: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    blocks = parse_readme(GROUPED).blocks
    run_python = KINDS["python"].run
    for n, block in enumerate(blocks[:2]):
        (tmp_path / str(n)).mkdir()
        ctx = Ctx(tmp_path / str(n), spawn, tmp_path_factory, blocks)
        run_python(block, plan(block).options, ctx)
    assert (tmp_path / "0" / "readme-blocks.json").exists()
    assert not (tmp_path / "1" / "readme-blocks.json").exists(), "the group ran twice"
    with pytest.raises(AssertionError) as info:
        run_python(
            blocks[2], plan(blocks[2]).options, Ctx(tmp_path, spawn, tmp_path_factory, blocks)
        )
    assert str(info.value).startswith("README.md:12 (```python): exit 1, expected 0")
    assert 'File "README.md", line 14' in str(info.value)  # the traceback points at the README
