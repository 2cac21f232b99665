"""The docs site and the README as its front door (issue 33): the site builds in strict mode, the README stays
short with `make demo` and `make test` first, and the modules of the API reference document their public names."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference"
README_MAX_LINES = 250


def _mkdocs() -> str | None:
    here = Path(sys.executable).with_name("mkdocs")
    return str(here) if here.exists() else shutil.which("mkdocs")


def reference_modules() -> list[str]:
    """The modules the API reference renders, from its `::: module` lines."""
    modules = []
    for page in sorted(REFERENCE.glob("*.md")):
        modules += re.findall(r"^:::\s+([\w.]+)\s*$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return modules


def undocumented(module: str) -> list[str]:
    """Public top-level functions and classes of `module` (read from its source) without a docstring."""
    parts = module.split(".")
    path = ROOT / "src" / Path(*parts).with_suffix(".py")
    if not path.exists():
        path = ROOT / "src" / Path(*parts) / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    missing = [] if ast.get_docstring(tree) else [f"{module} (module docstring)"]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if not (doc and doc.strip()):
                missing.append(f"{module}.{node.name}")
    return missing


def test_site_builds_strict(tmp_path: Path) -> None:
    mkdocs = _mkdocs()
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (it comes with the test extra: pip install -e '.[test]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "planner" / "index.html").exists()


def test_readme_is_a_short_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    commands = [line.split("#")[0].strip() for line in lines[start + 1 : end] if line.split("#")[0].strip()]
    assert commands[:2] == ["make demo", "make test"], commands


def test_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_reference_covers_the_public_modules() -> None:
    required = {
        "fastddrive.planner",
        "fastddrive.core.schema",
        "fastddrive.core.scaffold",
        "fastddrive.core.sample",
        "fastddrive.core.metrics",
        "fastddrive.core.inputs",
        "fastddrive.core.outputs",
        "fastddrive.engine.model",
        "fastddrive.engine.kv_cache",
        "fastddrive.engine.model_files",
        "fastddrive.decode.registry",
        "fastddrive.data.dataset",
        "fastddrive.eval.accuracy",
        "fastddrive.eval.bench",
        "fastddrive.drive.run",
        "fastddrive.serve.app",
        "fastddrive.train.loop",
        "fastddrive.train.config",
    }
    assert required <= set(reference_modules())


@pytest.mark.parametrize("module", reference_modules())
def test_public_names_have_docstrings(module: str) -> None:
    assert undocumented(module) == []


def test_moves_page_lists_every_move() -> None:
    from fastddrive._moved import MOVED

    page = (ROOT / "docs" / "moves.md").read_text(encoding="utf-8")
    for old, new in MOVED.items():
        row = f"| `{old}` | " + " and ".join(f"`{n}`" for n in new) + " |"
        assert row in page, f"docs/moves.md lacks {old} -> {', '.join(new)}"
