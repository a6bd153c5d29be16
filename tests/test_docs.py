"""The documentation: the site builds strictly, the README stays a front door, and the pages' commands run.

Runnable blocks: a fenced block tagged ``console`` in README.md or docs/*.md is run here, on this CPU. Each line
that starts with `$ ` is a command, run by bash in a fresh folder that holds the checkout's `train.py` and
`tests/data/ds_configs/` (a block's commands share the folder, in order), with this interpreter's folder first on
PATH, so `python` and `zerotune` are this environment's. The lines after a command, up to the next `$ `, are its
output (stdout and stderr together), matched line by line: a line `...` stands for any number of lines, `...`
within a line for any text, runs of spaces count as one, and a command shown without output must print nothing.
Blocks with any other tag, or none, are shown and not run: commands to adapt (a data set, a card, a cluster).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Blocks whose commands train (their first command's text): each takes longer than the others' seconds.
SLOW = ("zerotune train train.max_steps=",)


@dataclass(frozen=True)
class Step:
    command: str
    expected: tuple[str, ...]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the checkout
    line: int  # the opening fence's, 1-based
    steps: tuple[Step, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def console_blocks(path: Path) -> list[Block]:
    """The page's ```console blocks, each cut into its commands and their shown output."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```console\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, start, body = opening.group(1), i + 1, []
        i += 1
        while not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        steps: list[Step] = []
        for text in body:
            if text.startswith("$ "):
                steps.append(Step(text[2:], ()))
            else:
                assert steps, f"{path.name}:{start}: a console block starts with its first `$ ` command"
                steps[-1] = Step(steps[-1].command, (*steps[-1].expected, text))
        blocks.append(Block(str(path.relative_to(ROOT)), start, tuple(steps)))
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in console_blocks(page)]


def _squeeze(line: str) -> str:
    return re.sub(r"\s+", " ", line).strip()


def output_pattern(expected: tuple[str, ...]) -> re.Pattern:
    """The shown output as a regular expression over the real output's squeezed lines (see the module's note)."""
    parts = []
    for line in expected:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*".join(re.escape(piece) for piece in _squeeze(line).split("...")) + r"\n")
    return re.compile("".join(parts))


def matches(expected: tuple[str, ...], output: str) -> bool:
    text = "".join(_squeeze(line) + "\n" for line in output.splitlines())
    return output_pattern(expected).fullmatch(text) is not None


def workdir(tmp_path: Path) -> Path:
    """A fresh folder that a command sees as a checkout's root: train.py, and the DeepSpeed and accelerate files
    the pages copy from tests/data/ds_configs/."""
    work = tmp_path / "work"
    (work / "tests" / "data").mkdir(parents=True)
    shutil.copy(ROOT / "train.py", work / "train.py")
    shutil.copytree(ROOT / "tests" / "data" / "ds_configs", work / "tests" / "data" / "ds_configs")
    return work


def command_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "HYDRA_FULL_ERROR")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "src"), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _params():
    for block in BLOCKS:
        marks = [pytest.mark.slow] if block.steps and block.steps[0].command.startswith(SLOW) else []
        yield pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_a_console_block_prints_what_its_page_shows(block: Block, tmp_path):
    work, env = workdir(tmp_path), command_env()
    for step in block.steps:
        proc = subprocess.run(["bash", "-c", step.command], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600)
        shown = "\n".join(step.expected)
        assert matches(step.expected, proc.stdout), (
            f"{block.id}: `{step.command}` (exit {proc.returncode}) printed\n{proc.stdout[-4000:]}\n"
            f"--- where the page shows\n{shown}")


def test_the_pages_have_console_blocks_to_run():
    """The collection above cannot silently find nothing: the README and the pages hold runnable blocks, each
    with a command."""
    assert len(BLOCKS) >= 15, [b.id for b in BLOCKS]
    assert any(b.page == "README.md" for b in BLOCKS)
    assert all(b.steps for b in BLOCKS), [b.id for b in BLOCKS if not b.steps]
    assert sum(len(b.steps) for b in BLOCKS) >= 30


@pytest.mark.parametrize(("expected", "output", "ok"), [
    (("a", "b"), "a\nb\n", True),
    (("a",), "a\nb\n", False),
    (("a", "..."), "a\nb\nc\n", True),
    (("...", "c"), "a\nb\nc\n", True),
    (("a ... z",), "a middle z\n", True),
    (("a  b",), "a b   \n", True),
    ((), "", True),
    ((), "noise\n", False),
    (("x",), "y\n", False),
])
def test_the_output_convention(expected, output, ok):
    assert matches(expected, output) is ok


# ---------------------------------------------------------------- the site


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


def test_the_site_builds_strictly(tmp_path):
    proc = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for page in (ROOT / "docs").glob("*.md"):
        name = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (tmp_path / "site" / name).is_file(), page.name


@pytest.mark.parametrize(("page", "text", "named"), [
    ("planner.md", "\nSee [a page](no-such-page.md).\n", "no-such-page.md"),
    ("planner.md", "\nSee [a section](tune.md#no-such-section).\n", "no-such-section"),
    ("extra.md", "# A page the nav leaves out\n", "extra.md"),
])
def test_a_broken_link_or_a_page_left_out_fails_the_build(tmp_path, page, text, named):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / page, "a") as f:
        f.write(text)
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert named in proc.stdout + proc.stderr


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert re.search(rf":\s+{re.escape(page.name)}\s*$", nav, re.M), page.name


# ---------------------------------------------------------------- the README


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)


def test_the_readme_shows_the_set_up_and_test_commands():
    """CI runs the README's test command: exactly `make test`, in a code block; `make train` sets up and trains."""
    text = (ROOT / "README.md").read_text()
    fenced = "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S))
    commands = {line.split("#")[0].strip() for line in fenced.splitlines()}
    assert {"make test", "make train"} <= commands


def _slug(heading: str) -> str:
    from markdown.extensions.toc import slugify
    return slugify(heading, "-")


def test_the_readmes_links_reach_their_pages_and_sections():
    text = (ROOT / "README.md").read_text()
    links = [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", link)]
    assert sum(link.startswith("docs/") for link in links) >= 15
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, link
