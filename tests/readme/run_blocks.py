"""Run code blocks of one page (README.md or docs/**/*.md) as one program:
``python run_blocks.py SPEC.json``.

SPEC is ``{"setup": "plain", "page": "README.md", "blocks": [[line, text], ...]}``. The setup
module (a file beside this one) and then each block run in one namespace, named ``__main__``;
a block is compiled as its page at its own line numbers, so a traceback points at the page
(and its text is in ``linecache`` there, for code that reads its own source).
The setup's ``finish()`` runs after the last block (it writes what the test compares).
"""

from __future__ import annotations

import json
import linecache
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    namespace: dict[str, object] = {"__name__": "__main__"}
    setup = HERE / f"{spec['setup']}.py"
    exec(compile(setup.read_text(), str(setup), "exec"), namespace)
    page = spec.get("page", "README.md")
    _register_source(page, spec["blocks"])
    for line, text in spec["blocks"]:
        exec(compile("\n" * (line - 1) + text, page, "exec"), namespace)
    finish = namespace.get("finish")
    if callable(finish):
        finish()
    print("readme-blocks-done", flush=True)


def _register_source(page: str, blocks: list[list[object]]) -> None:
    """Give ``inspect.getsource`` the blocks' text at their lines of ``page`` (the run's working
    directory has no such file): TensorFlow's autograph reads a ``tf.function``'s source."""
    lines: list[str] = []
    for line, text in blocks:
        assert isinstance(line, int) and isinstance(text, str)
        lines += ["\n"] * (line - 1 - len(lines))
        lines[line - 1 :] = text.splitlines(keepends=True)
    linecache.cache[page] = (sum(map(len, lines)), None, lines, page)


if __name__ == "__main__":
    main()
