"""The layout's rules, checked on the source: no unused names or undefined ones (pyflakes),
no import cycle inside the package, the core free of frameworks, and the facts that belong to
one layer absent from the others."""
import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

from conftest import LONGEST_FILES, ROOT

PACKAGE = ROOT / "horovod_dgc"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: Set[str]) -> Set[str]:
    """The package's modules ``path`` imports, wherever the import statement stands."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from . import wire`` depends on the submodule, ``from .config import X`` on
            # the module that defines X.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found


def import_graph() -> Dict[str, Set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) - {name} for name, path in paths.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle as a list of modules, or [] (a depth-first search)."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_find_cycle_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_back():
    graph = import_graph()
    assert "horovod_dgc.core.config" in graph["horovod_dgc.core.methods"] | {
        m for deps in graph.values() for m in deps}
    assert find_cycle(graph) == []


def test_pyflakes_reports_nothing():
    proc = subprocess.run([sys.executable, "-m", "pyflakes", "horovod_dgc", "benchmarks",
                           "examples", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_core_imports_no_framework():
    for path in (PACKAGE / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            for name in names:
                assert name.split(".")[0] not in ("torch", "tensorflow", "numpy", "horovod"), \
                    f"{path.name} imports {name}"


def test_adapters_leave_methods_and_header_words_to_the_core():
    method_classes = ("BlockSign", "ScaleCom", "TopK", "GaussianK", "DGC(", "DGCConfig")
    families = ("SparseCompressor", "TwoStageCompressor", "SparseMethod", "TwoStageMethod")
    optimizer = (PACKAGE / "torch" / "optimizer.py").read_text()
    for word in method_classes + families:
        assert word not in optimizer, f"torch/optimizer.py names {word}"
    for path in list((PACKAGE / "torch").rglob("*.py")) + list((PACKAGE / "tensorflow").rglob("*.py")):
        text = path.read_text()
        assert "BlockSign" not in text and "ScaleCom(" not in text, path
        for word in ("HEADER_FIELDS", "HEADER_WORDS", "HEADER_BYTES"):
            assert word not in text, f"{path.relative_to(ROOT)} reads header words ({word})"


def test_benchmarks_live_in_their_wing_and_scripts_only_set_up():
    assert sorted(p.name for p in (ROOT / "scripts").iterdir()) == ["constraints.txt", "setup_env.sh"]
    assert not [p.name for p in (ROOT / "examples").glob("bench*")]
    for name in ("compress.py", "convergence.py", "cluster/run.py", "compose/compose_test.py"):
        assert (ROOT / "benchmarks" / name).is_file(), name


# The top level the project was specified with, plus its documentation, measurements and set-up.
TOP_LEVEL = {"setup.py", "horovod_dgc", "tests", "examples", "docker", "Makefile", "README.md",
             "docs", "benchmarks", "scripts"}


def test_the_top_level_is_the_specified_one():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:  # not a checkout (an unpacked archive): what is there
        names = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    else:
        names = {line.split("/")[0] for line in tracked.stdout.splitlines()}
        names = {n for n in names if not n.startswith(".")}
    assert names - {"pytest.ini"} == TOP_LEVEL, sorted(names ^ TOP_LEVEL)


def test_the_docker_recipe_is_at_the_top_and_its_harness_among_the_benchmarks():
    for name in ("Dockerfile", "docker-compose.yml", "shape_link.sh", "install_image.sh"):
        assert (ROOT / "docker" / name).is_file(), name
    assert not (ROOT / "docker" / "__init__.py").exists()  # would shadow the docker package
    assert not (ROOT / "benchmarks" / "docker").exists()


def test_the_files_make_test_starts_first_exist():
    """A renamed job file would silently fall to the end of make test's order (and the run
    take minutes longer on one process)."""
    assert [name for name in LONGEST_FILES if not (ROOT / "tests" / name).is_file()] == []
