"""bench/README.md is the catalog bench/catalog.py generates, and lists every
runnable benchmark; bench/'s layout keeps runnable modules out of bench/lib;
and every `python -m bench.*` / `python -m tests.*` command the docs name exists."""

from __future__ import annotations

import glob
import os
import re

from bench import catalog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = re.compile(r"""^if __name__ == ["']__main__["']:""", re.M)
DEF_MAIN = re.compile(r"^def main\(", re.M)


def runnable_modules() -> list[str]:
    """Every module under a package of bench/ (bench/lib excepted) with a
    __main__ block or a main(), found here without the catalog's code."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "*", "*.py"))):
        package = os.path.basename(os.path.dirname(path))
        if package == "lib" or path.endswith("__init__.py"):
            continue
        with open(path) as f:
            source = f.read()
        if MAIN.search(source) or DEF_MAIN.search(source):
            found.append(f"bench.{package}.{os.path.basename(path)[:-3]}")
    return found


def readme() -> str:
    with open(os.path.join(ROOT, "bench", "README.md")) as f:
        return f.read()


def test_every_runnable_module_has_a_row_in_bench_readme() -> None:
    mods = runnable_modules()
    assert len(mods) >= 10
    rows = [line for line in readme().splitlines() if line.startswith("| ")]
    missing = [m for m in mods if not any(f"`python -m {m}`" in r or f"`python -m {m} " in r for r in rows)]
    assert not missing, f"not in bench/README.md (run python -m bench.catalog --write): {missing}"


def test_bench_readme_is_what_the_catalog_generates() -> None:
    assert readme() == catalog.render(catalog.entries()), \
        "bench/README.md is stale: run python -m bench.catalog --write"


def test_every_runnable_module_follows_the_docstring_convention() -> None:
    found = catalog.entries()
    assert sorted(e.module for e in found) == sorted(runnable_modules())
    problems = [f"{e.module}: {p}" for e in found for p in e.problems]
    assert not problems, problems


def test_bench_lib_holds_no_runnable_module() -> None:
    for path in glob.glob(os.path.join(ROOT, "bench", "lib", "*.py")):
        with open(path) as f:
            assert not MAIN.search(f.read()), f"{path} is runnable: it belongs in bench/serving, micro or plots"


def test_bench_holds_only_packages_and_the_catalog() -> None:
    loose = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "bench", "*.py")))
    assert loose == ["__init__.py", "catalog.py"], loose


def test_the_docs_name_modules_that_exist() -> None:
    """`python -m bench.x.y` and `python -m tests.x.y` in the README, docs/, scripts/,
    bench/README.md and bench/'s docstrings all name a module that is there.
    bench/RESULTS.md, its history and docs/performance.md (the analyses moved
    from it) are left out: they record the commands as they were run."""
    records = {os.path.join(ROOT, "docs", "performance.md")}
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md")]
    for pattern in ("docs/*.md", "scripts/*.sh", "bench/*.py", "bench/*/*.py", "tests/gpu/*.py", ".ci/*"):
        paths += [p for p in glob.glob(os.path.join(ROOT, pattern)) if p not in records]
    bad = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        for mod in re.findall(r"python3? -m ((?:bench|tests)(?:\.\w+)+)", text):
            if not os.path.isfile(os.path.join(ROOT, *mod.split(".")) + ".py"):
                bad.append(f"{os.path.relpath(path, ROOT)}: {mod}")
    assert not bad, bad
