"""The package's import structure, read from the source with :mod:`ast` (nothing imported).

Every import that runs counts: module level and inside functions and methods (an import
in an ``if TYPE_CHECKING:`` block is not run, so it does not count). The rules, as
import-linter contracts would state them (docs/architecture.md, "Layers"):

* **layers**, top to bottom: the CLI; tooling (dev, drills, verify); the
  controller and the runner; leader election; the Kubernetes client and logging; the
  API types and the contracts the controller and the runner share (``neonvm.api``:
  quantities, the ``/scale`` protocol). A module imports only from its own layer or
  below (:data:`LAYERS`);
* **independence**: the controller and the runner never import each other; what both
  need lives in ``neonvm.api``;
* no import cycle among ``neonvm`` modules;
* no module of ``neonvm`` imports from the test tree or loads a file under it;
* inside the controller: the decision (``actions``, ``decide``, ``reasons``, ``looks``,
  ``restarts``, ``scan``) imports no other controller module but two pure helpers, and
  the performers, their context and the action table never import the loop;
* no module of ``neonvm.controller`` but ``fault_wiring`` imports fault injection
  (faults are composed around the production classes at the CLI).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1] / "neonvm"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("neonvm.__main__", "neonvm.cli", "neonvm.errors"),
    ("neonvm.dev", "neonvm.drills", "neonvm.verify",
     "neonvm.manifests", "neonvm.overview", "neonvm.invariant"),
    ("neonvm.controller", "neonvm.runner"),
    ("neonvm.leader",),
    ("neonvm.kube", "neonvm.logs"),
    ("neonvm.api", "neonvm"),
)
"""Packages from the top layer down; a module may import its own layer and the ones below.
``neonvm`` alone is the package itself (its ``__init__``), not everything under it."""

INDEPENDENT: tuple[tuple[str, str], ...] = (("neonvm.controller", "neonvm.runner"),)
"""Packages of one layer that never import each other."""

ENTRY_POINTS: frozenset[tuple[str, str]] = frozenset({
    ("neonvm.verify.__main__", "neonvm.cli.verify"),  # ``python -m neonvm.verify``
})
"""Imports exempt from the layers: an entry point that starts the CLI's command."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs: module level and inside functions, not under
    ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: set[str]) -> set[str]:
    """The ``neonvm`` modules an import statement loads (``from pkg import sub`` names
    the submodule when it is one)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out: set[str] = set()
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in known:
            out.add(sub)
        elif source in known:
            out.add(source)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in _import_nodes(tree):
            edges |= _targets(name, path.name == "__init__.py", node, known)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return cycles


def _importers(graph: dict[str, set[str]], of: str, target: str) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items()
                  if m == of or m.startswith(of + ".")
                  for t in ts if t == target or t.startswith(target + "."))


def test_no_import_cycle_in_neonvm() -> None:
    cycles = find_cycles(import_graph())
    assert cycles == [], f"import cycles among neonvm modules: {cycles}"


def _in(module: str, package: str) -> bool:
    if package == "neonvm":
        return module == "neonvm"
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the package ``module`` belongs to (0: top)."""
    for i, layer in enumerate(LAYERS):
        if any(_in(module, package) for package in layer):
            return i
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import against the layers or the independence rules, and every module
    that belongs to no layer."""
    found: list[str] = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        if mine is None:
            found.append(f"{module}: in no layer")
            continue
        for target in sorted(targets):
            theirs = layer_of(target)
            if (module, target) in ENTRY_POINTS or theirs is None:
                continue
            if theirs < mine:
                found.append(f"{module} -> {target}: imports upward")
            for a, b in INDEPENDENT:
                if (_in(module, a) and _in(target, b)) or (_in(module, b) and _in(target, a)):
                    found.append(f"{module} -> {target}: {a} and {b} are independent")
    return found


def test_every_import_respects_the_layers() -> None:
    assert layer_violations(import_graph()) == []


def _planted(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    """A throw-away ``neonvm`` tree with the given modules (packages made on the way)."""
    pkg = tmp_path / "neonvm"
    for name, source in {"__init__.py": "", **files}.items():
        path = pkg / name
        for parent in reversed(path.relative_to(tmp_path).parents[:-1]):
            (tmp_path / parent).mkdir(exist_ok=True)
            init = tmp_path / parent / "__init__.py"
            if not init.exists():
                init.write_text("")
        path.write_text(source)
    return import_graph(pkg)


@pytest.mark.parametrize(("files", "expected"), [
    ({"api/types.py": "from neonvm.controller import decide\n", "controller/decide.py": ""},
     "neonvm.api.types -> neonvm.controller.decide: imports upward"),
    ({"api/types.py": "def load():\n    from neonvm.cli import main\n", "cli/main.py": ""},
     "neonvm.api.types -> neonvm.cli.main: imports upward"),
    ({"leader/lock.py": "def f():\n    from ..controller import handler\n",
      "controller/handler.py": ""},
     "neonvm.leader.lock -> neonvm.controller.handler: imports upward"),
    ({"controller/scaling.py": "from neonvm.runner.scaling import pod_token\n",
      "runner/scaling.py": ""},
     "neonvm.controller.scaling -> neonvm.runner.scaling: "
     "neonvm.controller and neonvm.runner are independent"),
    ({"runner/main.py": "def f():\n    import neonvm.controller.podspec\n",
      "controller/podspec.py": ""},
     "neonvm.runner.main -> neonvm.controller.podspec: "
     "neonvm.controller and neonvm.runner are independent"),
    ({"controller/decide.py": "import neonvm.drills.campaign\n", "drills/campaign.py": ""},
     "neonvm.controller.decide -> neonvm.drills.campaign: imports upward"),
    ({"api/quantity.py": "def parse():\n    from neonvm.runner import qmp\n",
      "runner/qmp.py": ""},
     "neonvm.api.quantity -> neonvm.runner.qmp: imports upward"),
    ({"sidecar.py": ""}, "neonvm.sidecar: in no layer"),
])
def test_the_layer_rules_catch_a_planted_import(tmp_path: Path, files: dict[str, str],
                                                expected: str) -> None:
    """A module-level and a function-local upward import, a relative one, a cross import
    between the controller and the runner, and a module outside every layer all fail."""
    assert layer_violations(_planted(tmp_path, files)) == [expected]


SHARED_CONTRACTS = ("neonvm.api.quantity", "neonvm.api.scale_protocol")
"""What the API types, the controller and the runner share: quantities, and the ``/scale``
protocol (token, fence, JSON shapes). They sit in the bottom layer, so none of the three
climbs to reach them."""


def test_the_controller_and_the_runner_take_the_shared_contracts_from_the_bottom_layer() -> None:
    """Both sides import each shared contract from ``neonvm.api`` (with the independence
    rule, neither can take it from the other; with the layers, ``api`` takes it from no
    one above)."""
    graph = import_graph()
    for contract in SHARED_CONTRACTS:
        assert contract in graph and layer_of(contract) == len(LAYERS) - 1, contract
        for side in ("neonvm.controller", "neonvm.runner"):
            users = [m for m, targets in graph.items() if _in(m, side) and contract in targets]
            assert users, f"no module of {side} imports {contract}"


def test_the_layer_rules_let_downward_and_type_checking_imports_pass(tmp_path: Path) -> None:
    graph = _planted(tmp_path, {
        "api/types.py": "from typing import TYPE_CHECKING\n"
                        "if TYPE_CHECKING:\n    from neonvm.controller import decide\n",
        "controller/decide.py": "from neonvm.api import types\nfrom neonvm import kube\n",
        "runner/scaling.py": "def f():\n    from neonvm.api import types\n",
        "cli/main.py": "import neonvm.controller.decide\nimport neonvm.runner.scaling\n",
        "kube.py": "",
    })
    assert layer_violations(graph) == []


DECISION = frozenset({f"neonvm.controller.{m}" for m in (
    "actions", "decide", "reasons", "looks", "restarts", "scan")})
"""The pure decision and its vocabulary: they import, of the controller, only each other
and the two pure helpers of :data:`DECISION_HELPERS`."""
DECISION_HELPERS = frozenset({"neonvm.controller.autoscaler_view", "neonvm.controller.podspec"})
"""What an observation carries of NeonVM's autoscaler metadata; the memory slot size."""
DRIVER_LOOP = frozenset({f"neonvm.controller.{m}" for m in (
    "reconciler", "handler", "manager", "wiring", "fault_wiring")})
"""The loop and what runs it: the performers, their context and the action table
(:data:`PERFORMING`) never import these."""
PERFORMING = frozenset({f"neonvm.controller.{m}" for m in (
    "step", "performers", "action_table")})


def controller_violations(graph: dict[str, set[str]]) -> list[str]:
    """The controller's own layers: decision < performing < loop (docs/architecture.md,
    "Layers")."""
    found = [f"{m} -> {t}: the decision imports beyond itself"
             for m in sorted(DECISION & graph.keys()) for t in sorted(graph[m])
             if _in(t, "neonvm.controller") and t not in DECISION | DECISION_HELPERS]
    found += [f"{m} -> {t}: a performer imports the loop"
              for m in sorted(PERFORMING & graph.keys()) for t in sorted(graph[m])
              if t in DRIVER_LOOP]
    return found


def test_the_decision_and_the_performers_import_no_layer_above_them() -> None:
    assert controller_violations(import_graph()) == []


@pytest.mark.parametrize(("files", "expected"), [
    ({"controller/actions.py": "from neonvm.controller.reconciler import Reconciler\n",
      "controller/reconciler.py": ""},
     "neonvm.controller.actions -> neonvm.controller.reconciler: the decision imports "
     "beyond itself"),
    ({"controller/decide.py": "def f():\n    from . import cluster\n",
      "controller/cluster.py": ""},
     "neonvm.controller.decide -> neonvm.controller.cluster: the decision imports "
     "beyond itself"),
    ({"controller/performers.py": "def f():\n    import neonvm.controller.reconciler\n",
      "controller/reconciler.py": ""},
     "neonvm.controller.performers -> neonvm.controller.reconciler: a performer imports "
     "the loop"),
])
def test_the_controller_rules_catch_a_planted_import(tmp_path: Path, files: dict[str, str],
                                                     expected: str) -> None:
    """A module-level and a function-local import upward inside the controller fail; the
    driver importing the decision is the direction that is meant."""
    assert controller_violations(_planted(tmp_path, files)) == [expected]
    (tmp_path / "down").mkdir()
    downward = _planted(tmp_path / "down", {
        "controller/reconciler.py": "from neonvm.controller import decide, performers\n",
        "controller/performers.py": "from neonvm.controller import actions\n",
        "controller/decide.py": "", "controller/actions.py": ""})
    assert controller_violations(downward) == []


FAULT_MODULES = {"neonvm.controller.faults", "neonvm.controller.fault_wiring"}


def test_controller_modules_do_not_import_fault_injection() -> None:
    graph = import_graph()
    found = sorted(f"{m} -> {t}" for m, targets in graph.items()
                   if m.startswith("neonvm.controller.") and m not in FAULT_MODULES
                   for t in targets & FAULT_MODULES)
    assert found == []


def test_campaign_schedules_are_pure() -> None:
    """Schedule generation touches no cluster: it imports only the fault vocabulary and
    the driver's actions table (its crash steps are the table's steps, in its order)."""
    path = ROOT / "drills" / "schedule.py"
    imported = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        else:
            imported.add(node.module or "")
    assert imported <= {"__future__", "os", "random", "dataclasses",
                        "neonvm.controller.faults", "neonvm.controller.action_table"}, imported


def test_the_graph_reader_sees_each_kind_of_import(tmp_path: Path) -> None:
    """The checks above can fail: a two-module cycle through a function-level relative
    import is found, and a TYPE_CHECKING-only import is not counted."""
    pkg = tmp_path / "neonvm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from neonvm.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from neonvm import c\n"
        "def f():\n    from . import a\n")
    (pkg / "c.py").write_text("import neonvm.sub.a\n")
    graph = import_graph(pkg)
    assert graph["neonvm.sub.b"] == {"neonvm.sub.a"}
    assert graph["neonvm.c"] == {"neonvm.sub.a"}
    assert find_cycles(graph) == [["neonvm.sub.a", "neonvm.sub.b"]]


LOADERS = {"spec_from_file_location", "run_path", "SourceFileLoader", "exec_module"}
TEST_PATH = re.compile(r"^(\.\./)*tests(/[\w./-]*)?$")


def references_to_test_tree(root: Path = ROOT) -> list[str]:
    """Where a ``neonvm`` module reaches into the test tree: an import of ``tests``, a
    path built from ``"tests"`` (``ROOT / "tests"``, ``"tests/guest/x.py"``), or a
    call that loads source by path (``importlib.util.spec_from_file_location``,
    ``runpy.run_path``, a loader's ``exec_module``)."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent)
        tree = ast.parse(path.read_text(), str(path))
        for node in _import_nodes(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [] if node.level else [node.module or ""])
            found += [f"{where}:{node.lineno}: imports {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and TEST_PATH.match(node.value)):
                found.append(f"{where}:{node.lineno}: path {node.value!r}")
            elif isinstance(node, ast.Call):
                func = node.func
                name = (func.attr if isinstance(func, ast.Attribute)
                        else func.id if isinstance(func, ast.Name) else "")
                if name in LOADERS:
                    found.append(f"{where}:{node.lineno}: loads source by path ({name})")
    return found


def test_product_never_loads_test_code() -> None:
    assert references_to_test_tree() == []


@pytest.mark.parametrize("planted", [
    "from tests.guest.build import build_guest\n",
    "def f():\n    import tests.support\n",
    "from pathlib import Path\nSOURCE = Path(__file__).parents[2] / 'tests' / 'x.py'\n",
    "import importlib.util\n"
    "def f(p):\n    importlib.util.spec_from_file_location('m', p)\n",
])
def test_the_test_tree_rule_catches_a_planted_reference(tmp_path: Path, planted: str
                                                         ) -> None:
    pkg = tmp_path / "neonvm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "clean.py").write_text('"""Docs may name tests/guest/init.sh."""\nX = 1\n')
    (pkg / "planted.py").write_text(planted)
    found = references_to_test_tree(pkg)
    assert found and all(f.startswith("neonvm/planted.py:") for f in found), found


TESTS = ROOT.parent / "tests"


def cross_test_imports(tests: Path = TESTS) -> set[tuple[str, str]]:
    """(file, module) for every import of a test module (``tests.test_*``) by a file under
    ``tests``, module level or inside a function."""
    found: set[tuple[str, str]] = set()
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = ([f"tests.{a.name}" for a in node.names] if node.module == "tests"
                         else [node.module or ""])
            else:
                continue
            found |= {(path.relative_to(tests.parent).as_posix(), n) for n in names
                      if n.startswith("tests.test_")}
    return found


def test_a_test_module_imports_no_other_test_module() -> None:
    """Helpers two test files share live in ``tests/support/`` (shared fixtures are
    registered in ``tests/conftest.py``), never in a test module another one imports."""
    assert cross_test_imports() == set()


@pytest.mark.parametrize("planted", [
    "from tests.test_b import helper\n",
    "def f():\n    import tests.test_b\n",
    "from tests import test_b\n",
])
def test_the_test_import_rule_catches_a_planted_import(tmp_path: Path, planted: str) -> None:
    (tmp_path / "tests" / "support").mkdir(parents=True)
    (tmp_path / "tests" / "support" / "ok.py").write_text("from tests.support import x\n")
    (tmp_path / "tests" / "test_a.py").write_text(planted)
    assert cross_test_imports(tmp_path / "tests") == {("tests/test_a.py", "tests.test_b")}
