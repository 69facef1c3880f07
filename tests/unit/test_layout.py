"""The layout holds: no import cycle between files of src/rl, no module over 400 lines, the packages every process
shares import none of the processes, and the README stays a tour (at most 2,000 words, every module in its tree)."""

import importlib.util
import re

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(graph)

PROCESSES = ("rl.orchestrator", "rl.trainer", "rl.inference", "rl.launcher", "rl.eval")


def test_no_import_cycle_between_files_and_no_module_over_400_lines():
    assert graph.cycles(graph.imports(ROOT)) == []
    assert graph.long_modules(ROOT) == {}


@pytest.mark.parametrize("shared", ["rl.envs", "rl.weights", "rl.process", "rl.protocol", "rl.config"])
def test_what_processes_share_imports_no_process(shared):
    edges = graph.imports(ROOT)
    reached = {target for name, targets in edges.items() if name == shared or name.startswith(shared + ".")
               for target in targets if target.startswith(PROCESSES)}
    assert reached == set()


def test_the_readme_is_a_tour_with_every_module_in_its_tree():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split()) <= 2000
    tree = readme[readme.index("src/rl/\n"):]
    tree = tree[:tree.index("```")]
    listed, folder = set(), ""
    for line in tree.splitlines()[1:]:
        indent, name = re.match(r"( *)(\S+)", line).groups() if line.strip() else ("", "")
        if name.endswith("/"):
            folder = name
        elif name.endswith(".py"):
            listed.add(f"{folder}{name}" if len(indent) > 2 else name)
    modules = {str(path.relative_to(ROOT / "src" / "rl")) for path in (ROOT / "src" / "rl").rglob("*.py")
               if path.name != "__init__.py"}
    assert modules - listed == set()
