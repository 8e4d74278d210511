"""The README harness (tests/support/readme.py) on its own: how it reads Markdown, what each
marker asks for, and the checks that need no block to run (parsing, option and YAML checks,
the normalisation of sample output). Running blocks is tests/integration/test_readme.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.readme import (
    KINDS,
    README,
    Block,
    Ctx,
    Plan,
    check_options,
    commands_of,
    documents,
    makefile_recipes,
    needs_framework,
    page_name,
    parse_readme,
    plan,
    shape,
    timeout_of,
    unique_blocks,
)

pytestmark = pytest.mark.timeout(60)


def one(markdown: str) -> Block:
    [block] = parse_readme(markdown).blocks
    return block


def ctx(tmp_path: Path, blocks: list[Block] | None = None) -> Ctx:
    def no_spawn(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a check that runs nothing started a process")

    return Ctx(tmp_path, no_spawn, None, blocks or [])  # type: ignore[arg-type]


# -- reading the Markdown --------------------------------------------------------------------

SAMPLE = """\
Intro.

```python
print("no marker")
```

<!-- readme-test: skip: shown only -->
```bash
rm -rf /
```

<!-- readme-test: loop setup=plain at=5 -->
  ```python
  for step in handler.steps(total): train_step(step)
  ```
<!-- readme-test: skip: a marker with a blank line after it -->

```text
out
```
<!-- readme-test: lop -->
```python
x = 1
```
"""


def test_blocks_their_lines_languages_and_markers() -> None:
    parsed = parse_readme(SAMPLE)
    assert [(b.fence_line, b.lang, b.marker) for b in parsed.blocks] == [
        (3, "python", None),
        (8, "bash", "skip: shown only"),
        (13, "python", "loop setup=plain at=5"),
        (18, "text", None),  # its marker is not right before the fence
        (22, "python", "lop"),
    ]
    assert parsed.blocks[2].text == "for step in handler.steps(total): train_step(step)\n"
    assert parsed.blocks[2].line == 14 and parsed.blocks[2].where == "README.md:13 (```python)"
    assert [b.id for b in parsed.blocks[:2]] == ["README/00-print-no-marker", "README/01-rm-rf"]
    assert parsed.problems == [
        "README.md:16: a readme-test marker must be one line (<!-- readme-test: ... -->) "
        "right before an opening fence"
    ]


def test_tilde_and_longer_fences_keep_shorter_fences_inside() -> None:
    parsed = parse_readme(
        "````markdown\n```python\nx = 1\n```\n````\n\n~~~sh\necho ```\n~~~\n\n```\nbare\n```\n"
    )
    assert [(b.lang, b.text) for b in parsed.blocks] == [
        ("markdown", "```python\nx = 1\n```\n"),
        ("sh", "echo ```\n"),
        ("", "bare\n"),
    ]
    assert parsed.problems == []


def test_a_fence_never_closed_is_a_problem() -> None:
    parsed = parse_readme("text\n```python\nx = 1\n")
    assert parsed.problems == ["README.md:2: a fence that is never closed"]
    assert [b.text for b in parsed.blocks] == ["x = 1\n"]


def test_a_marker_on_two_lines_is_a_problem() -> None:
    parsed = parse_readme("<!-- readme-test: python\n-->\n```python\nx = 1\n```\n")
    assert parsed.blocks[0].marker is None
    assert parsed.problems and parsed.problems[0].startswith("README.md:1: a readme-test marker")


# -- what a marker asks for --------------------------------------------------------------------


def test_plans_of_the_sample() -> None:
    blocks = parse_readme(SAMPLE).blocks
    with pytest.raises(AssertionError, match=r"README.md:3 \(```python\) has no test"):
        plan(blocks[0])
    assert plan(blocks[1]) == Plan("skip", {"why": "shown only"})
    assert plan(blocks[2]) == Plan("loop", {"setup": "plain", "at": "5"})
    with pytest.raises(AssertionError, match="has no test"):
        plan(blocks[3])
    with pytest.raises(AssertionError, match="KIND is one of"):
        plan(blocks[4])


@pytest.mark.parametrize(
    ("marker", "lang", "message"),
    [
        ("skip:", "python", "'skip:' needs a reason"),
        (
            "python bogus=1",
            "python",
            r"option 'bogus' is not one of python's \(exit, group, setup\)",
        ),
        ("yaml exit=1", "yaml", r"option 'exit' is not one of yaml's \(none\)"),
        ("python", "bash", r"python is for ```python blocks"),
        ("shell", "python", r"shell is for ```bash/sh/shell blocks"),
        ("loop setup=mx", "python", "setup= is one of plain, lightning, keras, tensorflow, trans"),
        ('make why="unbalanced', "bash", "No closing quotation"),
    ],
)
def test_a_marker_that_cannot_be_followed_says_why(marker: str, lang: str, message: str) -> None:
    block = one(f"<!-- readme-test: {marker} -->\n```{lang}\nx\n```\n")
    with pytest.raises(AssertionError, match=message):
        plan(block)


def test_quoted_option_values_keep_their_spaces() -> None:
    block = one(
        '<!-- readme-test: make run=demo skip=test why="runs the suite" -->\n```bash\nx\n```\n'
    )
    assert plan(block) == Plan("make", {"run": "demo", "skip": "test", "why": "runs the suite"})


def test_commands_to_start_in_the_background_and_time_limits() -> None:
    def block(marker: str, lang: str = "bash") -> Block:
        return one(f"<!-- readme-test: {marker} -->\n```{lang}\nmake demo\n```\n")

    assert commands_of(block("make run=demo,lint skip=test why=x")) == ["make demo", "make lint"]
    assert commands_of(block('output of="make demo"', "text")) == ["make demo"]
    assert commands_of(block("output", "text")) == []
    assert commands_of(block("script")) == []
    assert commands_of(one("```bash\nmake demo\n```\n")) == []  # no marker: nothing to start
    assert timeout_of(block("loop", "python")) == KINDS["loop"].timeout == 240
    assert timeout_of(block("script")) == 60
    assert timeout_of(block("nonsense")) == 60


def test_a_skip_and_an_output_without_a_command_skip(tmp_path: Path) -> None:
    skipped = one("<!-- readme-test: skip: needs a cluster -->\n```bash\nsbatch x\n```\n")
    with pytest.raises(pytest.skip.Exception, match="needs a cluster"):
        KINDS["skip"].run(skipped, plan(skipped).options, ctx(tmp_path))
    sample = one("<!-- readme-test: output -->\n```text\nstep 1\n```\n")
    with pytest.raises(pytest.skip.Exception, match="output, not code"):
        KINDS["output"].run(sample, {}, ctx(tmp_path))


def test_a_group_may_not_mix_kinds_or_setups(tmp_path: Path) -> None:
    blocks = parse_readme(
        "<!-- readme-test: python setup=bare group=g -->\n```python\nx = 1\n```\n\n"
        "<!-- readme-test: python setup=plain group=g -->\n```python\ny = 2\n```\n"
    ).blocks
    with pytest.raises(AssertionError, match=r"README.md:7 \(```python\): group g mixes"):
        KINDS["python"].run(blocks[0], plan(blocks[0]).options, ctx(tmp_path, blocks))


def test_every_block_of_the_readme_and_the_docs_has_a_plan() -> None:
    pages = documents()
    assert pages[0] == README and len(pages) > 1, "the docs site's pages are read too"
    kinds = set()
    for path in pages:
        parsed = parse_readme(path.read_text(), page_name(path))
        assert not parsed.problems, parsed.problems
        kinds |= {plan(block).kind for block in parsed.blocks}  # each raises with its line
    assert {"python", "loop", "shell", "yaml", "make", "output", "trainer", "torchrun"} <= kinds


def test_a_page_names_its_blocks_and_its_problems() -> None:
    text = "<!-- readme-test: python setup=bare -->\n```python\nx = 1\n```\n\n```python\n"
    parsed = parse_readme(text, "docs/frontends/keras.md")
    block = parsed.blocks[0]
    assert block.where == "docs/frontends/keras.md:2 (```python)"
    assert block.id == "frontends/keras/00-x-1"
    assert parsed.problems == ["docs/frontends/keras.md:6: a fence that is never closed"]


def test_a_group_is_one_page_s(tmp_path: Path) -> None:
    marker = "<!-- readme-test: python setup=bare group=g -->\n```python\nx = 1\n```\n"
    a = parse_readme(marker, "docs/a.md").blocks
    b = parse_readme(marker * 2, "docs/b.md").blocks
    from tests.support.readme import _members

    assert _members(a[0], plan(a[0]).options, a + b) == a
    assert _members(b[1], plan(b[1]).options, a + b) == b


@pytest.mark.parametrize(
    ("marker", "framework"),
    [
        ("loop setup=lightning", True),
        ("loop setup=keras", True),
        ("python setup=transformers", True),
        ("trainer", True),
        ("torchrun launcher=accelerate", True),
        ("loop setup=plain", False),
        ("python setup=bare", False),
        ("skip: shown only", False),
    ],
)
def test_framework_blocks_go_to_the_frameworks_lane(marker: str, framework: bool) -> None:
    assert needs_framework(one(f"<!-- readme-test: {marker} -->\n```python\nx\n```\n")) == framework


def test_a_block_repeated_on_another_page_runs_once() -> None:
    loop = "<!-- readme-test: loop setup=plain -->\n```python\nx = 1\n```\n"
    other = "<!-- readme-test: loop setup=plain at=5 -->\n```python\nx = 1\n```\n"
    grouped = "<!-- readme-test: python setup=bare group=g -->\n```python\ny = 1\n```\n"
    readme = parse_readme(loop + grouped).blocks
    page = parse_readme(loop + other + grouped, "docs/p.md").blocks
    kept = unique_blocks(readme + page)
    assert kept == [*readme, page[1], page[2]], "the repeat goes; another marker or a group stays"


def test_transformers_set_up_is_for_python_blocks() -> None:
    block = one("<!-- readme-test: loop setup=transformers -->\n```python\nx\n```\n")
    with pytest.raises(AssertionError, match="setup=transformers is for python blocks"):
        plan(block)


# -- checks that run no block --------------------------------------------------------------


def test_options_are_checked_against_help() -> None:
    check_options(["preemptible", "run", "[--max-failures", "N]", "--", "x", "--bogus"], "t")
    with pytest.raises(AssertionError, match="--bogus`: no such option"):
        check_options(["preemptible", "run", "--bogus", "--", "python", "train.py"], "t")
    with pytest.raises(AssertionError, match="takes a value"):
        check_options(["preemptible", "run", "--max-failures", "--", "x"], "t")
    with pytest.raises(AssertionError, match="no such command"):
        check_options(["preemptible", "rnu", "--", "x"], "t")


def test_command_lines_behind_prefixes_continuations_and_comments(tmp_path: Path) -> None:
    good = one(
        "<!-- readme-test: synopsis -->\n```bash\n# preemptible run --nope (a comment)\n"
        "FOO=1 exec .venv/bin/preemptible run \\\n    --max-failures 3 -- python train.py\n```\n"
    )
    KINDS["synopsis"].run(good, {}, ctx(tmp_path))
    continued = good.text.replace("--max-failures 3", "--nope")
    with pytest.raises(AssertionError, match="--nope`: no such option"):
        KINDS["synopsis"].run(one(f"```bash\n{continued}```\n"), {}, ctx(tmp_path))
    none = one("```bash\necho preemptible run\n```\n")
    with pytest.raises(AssertionError, match="no `preemptible` command in it"):
        KINDS["synopsis"].run(none, {}, ctx(tmp_path))


def test_a_script_must_parse_as_bash(tmp_path: Path) -> None:
    KINDS["script"].run(one("```bash\nif true; then echo ok; fi\n```\n"), {}, ctx(tmp_path))
    with pytest.raises(AssertionError, match="bash -n"):
        KINDS["script"].run(one("```bash\nif true; then echo ok\n```\n"), {}, ctx(tmp_path))
    [script] = parse_readme(
        "```bash\npip install preemptible\nexec .venv/bin/preemptible run --nope -- x\n```\n"
    ).blocks
    with pytest.raises(AssertionError, match="--nope`: no such option"):
        KINDS["script"].run(script, {}, ctx(tmp_path))


POD = """\
<!-- readme-test: yaml -->
```yaml
spec:
  terminationGracePeriodSeconds: 120
  containers:
    - command: ["preemptible", "run", "--checkpoint-dir", "/ckpt", "--", "python", "t.py"]
      env: [{name: PREEMPTIBLE_GRACE_PERIOD, value: "%s"}]
```
"""


def test_yaml_commands_in_exec_form_and_the_grace_period_agree(tmp_path: Path) -> None:
    run_yaml = KINDS["yaml"].run
    run_yaml(one(POD % "120"), {}, ctx(tmp_path))
    with pytest.raises(AssertionError, match="PREEMPTIBLE_GRACE_PERIOD=30 but"):
        run_yaml(one(POD % "30"), {}, ctx(tmp_path))
    with pytest.raises(AssertionError, match="a shell as PID 1"):
        run_yaml(one(POD.replace('"preemptible", "run"', '"sh", "-c"') % "120"), {}, ctx(tmp_path))
    as_string = "<!-- readme-test: yaml -->\n```yaml\ncommand: preemptible run -- x\n```\n"
    with pytest.raises(AssertionError, match="use the exec form"):
        run_yaml(one(as_string), {}, ctx(tmp_path))


def test_a_sweep_spec_must_load_with_no_key_ignored(tmp_path: Path) -> None:
    spec = "program: t.py\nmethod: grid\nparameters:\n  lr: {values: [1, 2]}\n"
    KINDS["sweep"].run(one(f"```yaml\n{spec}```\n"), {}, ctx(tmp_path))
    with pytest.raises(AssertionError, match=r"keys without effect: \('project',\)"):
        KINDS["sweep"].run(one(f"```yaml\n{spec}project: p\n```\n"), {}, ctx(tmp_path))


def test_make_lines_name_targets_that_are_run_or_skipped_with_a_reason(tmp_path: Path) -> None:
    def make(marker: str, line: str = "make lint") -> None:
        block = one(f"<!-- readme-test: {marker} -->\n```bash\n{line}\n```\n")
        KINDS["make"].run(block, plan(block).options, ctx(tmp_path))

    make('make skip=lint why="not here"')
    with pytest.raises(AssertionError, match=r"skip= needs why="):
        make("make skip=lint")
    with pytest.raises(AssertionError, match="add it to run= or skip="):
        make('make skip=test why="x"')
    with pytest.raises(AssertionError, match="no such target in Makefile"):
        make('make skip=lint why="x"', "make nonsense")
    with pytest.raises(AssertionError, match="is not a make command"):
        make('make skip=lint why="x"', "pip install x")


def test_makefile_recipes_expand_variables_and_overrides() -> None:
    text = (
        "VENV ?= .venv\nBIN := $(VENV)/bin\n.PHONY: a b\n"
        "a b: dep\n\t$(BIN)/python -m x\n\techo $(NAME)\n\n# comment\nc:\n\ttrue\n"
    )
    recipes = makefile_recipes(text, {"NAME": "n"})
    assert recipes["a"] == recipes["b"] == [".venv/bin/python -m x", "echo n"]
    assert recipes["c"] == ["true"] and ".PHONY" not in recipes
    assert makefile_recipes(text, {"BIN": "/usr/bin"})["a"][0] == "/usr/bin/python -m x"


def test_sample_output_is_compared_without_paths_ids_ages_or_numbers() -> None:
    a = "  1. sweep qq7im5x4 created in /tmp/x/q.db\nrun qq7im5x4-5 loss=0.33867 · 38s ago\n\n"
    b = "  1. sweep ab12cd34 created in /tmp/o/q.db\nrun ab12cd34-2 loss=1.5   ·  1m02s ago\n"
    assert (
        shape(a)
        == shape(b)
        == [
            "N. sweep ID created in PATH",
            "run ID-N loss=N · AGE ago",
        ]
    )
    assert shape("agent exit 143") != shape("agent exit code 143")


def test_the_readme_s_relative_links_name_files_that_exist() -> None:
    """The README links into docs/ with relative links, which work on GitHub as they are; the
    site's own links are checked by `make docs` (strict)."""
    import re

    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in relative)
    missing = [link for link in relative if not (README.parent / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
