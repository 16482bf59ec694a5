"""The documentation's Python snippets run as written.

Every ```python block of README.md, docs/getting-started.md and docs/fabric.md runs as a script
in a subprocess (Lightning's and Fabric's launchers re-run the script for the other ranks, which
inside pytest would re-run pytest), in an empty working directory, on the CPU ranks the snippet
asks for. An HTML comment on the line before a block says how to treat it:

* ``<!-- docs-test: skip -->``: a fragment (it uses names the reader supplies): not run;
* ``<!-- docs-test: setup -->``: not run alone; the page's later blocks marked
  ``<!-- docs-test: with-setup -->`` run with it prepended (a model defined once per page).

The same script on two pages (the README repeats the guides' first examples) runs once.

The package's docstrings are written for mkdocstrings: no Sphinx role (``:class:`...```) in them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/getting-started.md", "docs/fabric.md")
_BLOCK = re.compile(
    r"^(?:<!-- docs-test: (?P<mark>[a-z-]+) -->\n)?```python\n(?P<code>.*?)^```", re.M | re.S
)
# a Sphinx role, which mkdocstrings shows as written
_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj|const):`")
# what the strategies print when compression starts (phase_switch.py)
_SWITCHED = re.compile(r"phase \(1-bit exchange\) from optimizer step \d+")


@dataclass(frozen=True)
class Snippet:
    where: str  # page:line
    mark: str | None
    script: str


def _snippets(page: str) -> list[Snippet]:
    text = (ROOT / page).read_text()
    setup: str | None = None
    found = []
    for m in _BLOCK.finditer(text):
        mark, code = m.group("mark"), m.group("code")
        where = f"{page}:{text.count(chr(10), 0, m.start('code')) + 1}"
        if mark not in (None, "skip", "setup", "with-setup"):
            raise ValueError(f"{where}: unknown docs-test mark {mark!r}")
        if mark == "setup":
            setup = code
        elif mark == "with-setup":
            if setup is None:
                raise ValueError(f"{where}: with-setup before any setup block on the page")
            code = setup + "\n" + code
        found.append(Snippet(where, mark, code))
    return found


def _runnable() -> list[Snippet]:
    unique: dict[str, Snippet] = {}
    for page in PAGES:
        for s in _snippets(page):
            if s.mark in (None, "with-setup"):
                unique.setdefault(s.script, s)
    return list(unique.values())


def test_every_page_has_runnable_snippets_and_marks_its_fragments() -> None:
    for page in PAGES:
        snippets = _snippets(page)
        runnable = [s for s in snippets if s.mark in (None, "with-setup")]
        assert runnable, f"{page}: no Python snippet runs"
        assert len(runnable) >= len(snippets) / 2, f"{page}: most snippets should run"


def test_readme_shows_the_command_ci_runs() -> None:
    # .ci/run calls it; the README must say it (the second of the two commands)
    ci = (ROOT / ".ci/run").read_text()
    assert "bash scripts/test.sh" in ci
    assert "bash scripts/test.sh" in (ROOT / "README.md").read_text()


def test_the_package_has_no_sphinx_roles() -> None:
    # cross-references are [`Name`][lightning_onebit.module.Name], other names ``name``
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "lightning_onebit").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _ROLE.search(line)
    ]
    assert not found, f"{len(found)} Sphinx roles (mkdocstrings renders them raw): {found[:10]}"


@pytest.mark.slow
@pytest.mark.parametrize("snippet", _runnable(), ids=lambda s: s.where)
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(snippet.script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)  # a fresh launch, whatever runs pytest
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{snippet.where} failed:\n{out[-4000:]}"
    if "lightning_onebit" in snippet.script:  # it trains with a 1-bit strategy: past the warmup
        assert _SWITCHED.search(out), f"{snippet.where}: compression never started:\n{out[-3000:]}"
