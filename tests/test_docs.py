"""The docs: every link in README.md and docs/*.md resolves, and the configuration reference is current."""

import re
from pathlib import Path

import pytest
from torch.optim.lr_scheduler import LRScheduler

from astrai_pl import config_reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are left alone
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def links(page: Path) -> list[str]:
    """The targets of the page's markdown links, outside code blocks and code spans."""
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: — not checked offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_link_checker_sees_links_and_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Weights & Biases\n\n[a](other.md#x) `[b](code.md)`\n```\n[c](fenced.md)\n```\n")
    assert links(page) == ["other.md#x"]
    assert anchors(page) == {"weights--biases"}


def test_the_configuration_reference_is_current():
    assert config_reference.OUTPUT.read_text() == config_reference.render(), (
        "docs/configuration-reference.md is out of date: run python -m astrai_pl.config_reference")


# The schedules' arguments are described in their class docstrings rather than one by one.
DOCUMENTED = [cls for _, _, classes in config_reference.GROUPS for cls in classes
              if not issubclass(cls, LRScheduler)]


@pytest.mark.parametrize("cls", DOCUMENTED, ids=lambda cls: cls.__name__)
def test_every_argument_is_documented(cls):
    assert config_reference.undocumented(cls) == []


def test_the_serving_page_lists_every_serve_option():
    """docs/serving.md's option table names exactly the options `astrai-pl serve` takes."""
    from astrai_pl.serve.cli import serve_parser

    parser = serve_parser()
    taken = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    table = (ROOT / "docs" / "serving.md").read_text().split("## Options", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(--[a-z-]+)", table))
    assert documented == taken, f"undocumented: {sorted(taken - documented)}, gone: {sorted(documented - taken)}"
