"""The package's shape: layers, no import cycles, short functions, core files that fit.

The import graph holds every ``import`` / ``from ... import`` anywhere in a module
(function bodies included) and every ``importlib.import_module(...)`` or
``__import__(...)`` whose argument is a string literal, a module-level or local string
constant, or an f-string / ``+`` with such a prefix (a prefix stands for every package
module under it: the registry's discovery of ``veloxquant_mlx.cache.<name>``); one it
cannot read must be listed in ``UNRESOLVED_ALLOWED`` with the reason it is safe. Imports under ``if TYPE_CHECKING:`` are
kept apart: they never run, so they are not part of the runtime graph the cycle check
walks, but they must respect the layers like any other import.

Layers, lowest first; a module may import its own layer and the layers below it:

1. ``ops``: numerics, no other package module.
2. core: options, config, the registry, errors, version, allocator readings
   (``memory``), the 0.1 compatibility (``compat``) and ``cache/``.
3. adapter: ``adapter/`` (mlx_lm routing, probe, builder, prefill, retained-bytes
   measurement) and ``models/`` (model loading).
4. applications: ``apps/`` (saved caches, server, distributed runs, demo, BLAS, malloc thresholds).
5. tools: ``eval/`` (harness, bench, tune, load tests; a load test starts the server).
6. entry points: the package ``__init__``, ``cli`` and ``__main__``.

``testing/`` (test support) may import anything; nothing in the package outside
``testing/`` may import it.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "veloxquant_mlx"
ROOT = "veloxquant_mlx"
MAX_FUNCTION_LINES = 60
MAX_CORE_LINES = 500

LAYERS: dict[str, tuple[str, ...]] = {
    "ops": ("ops",),
    "core": ("options", "config", "registry", "register", "errors", "_version", "memory",
             "compat", "deps", "mlx_lm_private", "cache"),
    "adapter": ("adapter", "models"),
    "applications": ("apps",),
    "tools": ("eval",),
    "entry points": ("", "cli", "__main__"),
}
TEST_SUPPORT = "testing"
CORE_LAYERS = ("ops", "core")

# Dynamic imports whose target the graph cannot read from the source, and why each is
# safe to leave out of it.
UNRESOLVED_ALLOWED: dict[str, str] = {
    f"{ROOT}.apps.prompt_cache": "rebuilds mlx_lm's own cache classes named in a saved "
                                 "file; any module outside mlx_lm. is refused first",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@dataclass
class Imports:
    """What one module imports: at run time, only for type checkers, and unreadable."""

    runtime: set[str] = field(default_factory=set)
    typing: set[str] = field(default_factory=set)
    unresolved: list[int] = field(default_factory=list)  # line numbers


def _string_constants(scope: ast.AST) -> dict[str, ast.expr | None]:
    """Names assigned exactly once in ``scope`` (not in the functions it defines); the
    value, or ``None`` when the name is assigned more than once."""
    out: dict[str, ast.expr | None] = {}
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            out[name] = None if name in out else node.value
        todo.extend(ast.iter_child_nodes(node))
    return out


def _literal_prefix(node: ast.expr | None, consts: dict[str, ast.expr | None],
                    depth: int = 0) -> tuple[str, bool] | None:
    """``(text, complete)``: the literal text ``node`` starts with, and whether that is all
    of it; ``None`` when it starts with nothing readable."""
    if node is None or depth > 8:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, True
    if isinstance(node, ast.Name):
        return _literal_prefix(consts.get(node.id), consts, depth + 1)
    parts: list[ast.expr] = []
    if isinstance(node, ast.JoinedStr):
        parts = [v.value if isinstance(v, ast.FormattedValue) and v.conversion == -1
                 and v.format_spec is None else v for v in node.values]
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        parts = [node.left, node.right]
    text = ""
    for part in parts:
        got = _literal_prefix(part, consts, depth + 1)
        if got is None:
            return (text, False) if text else None
        text += got[0]
        if not got[1]:
            return text, False
    return (text, True) if parts else None


def _is_import_module(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module"
            and isinstance(f.value, ast.Name) and f.value.id == "importlib") \
        or (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _in_package(target: str, modules: set[str]) -> str | None:
    # The module ``target`` names, or the package module it is in.
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target if target.startswith(ROOT) else None


def module_imports(name: str, source: str, is_package: bool, modules: set[str]) -> Imports:
    """The package modules ``name`` (with ``source``) imports, sorted by kind."""
    tree = ast.parse(source)
    out = Imports()

    def add(targets: list[str], typing_only: bool) -> None:
        for t in targets:
            found = _in_package(t, modules)
            if found and found != name:
                (out.typing if typing_only else out.runtime).add(found)

    def visit(node: ast.AST, typing_only: bool, consts: dict[str, ast.expr | None]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # A function's own names first, then the module's.
            consts = {**consts, **_string_constants(node)}
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True, consts)
            for child in node.orelse:
                visit(child, typing_only, consts)
            return
        if isinstance(node, ast.Import):
            add([a.name for a in node.names], typing_only)
        elif isinstance(node, ast.ImportFrom):
            # ``from x import y`` imports module x.y when it is one, else x (for its y).
            base = _resolve(name, is_package, node)
            add([f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                 for a in node.names], typing_only)
        elif isinstance(node, ast.Call) and _is_import_module(node) and node.args:
            got = _literal_prefix(node.args[0], consts)
            if got is None or got[0].startswith("."):  # unreadable, or relative to a package
                out.unresolved.append(node.lineno)
            elif got[1]:
                add([got[0]], typing_only)
            elif got[0].startswith(ROOT):
                # A prefix: any module under it may be imported.
                (out.typing if typing_only else out.runtime).update(
                    m for m in modules if m.startswith(got[0]) and m != name)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only, consts)

    visit(tree, False, _string_constants(tree))
    return out


@functools.cache
def package_imports() -> dict[str, Imports]:
    """Every package module and what it imports (read once per test process)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: module_imports(name, path.read_text(encoding="utf-8"),
                                 path.name == "__init__.py", set(paths))
            for name, path in paths.items()}


def import_graph() -> dict[str, set[str]]:
    """Package module -> package modules it imports at run time (anywhere in its body)."""
    return {m: set(i.runtime) for m, i in package_imports().items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            # A package's __init__ importing its own submodules is not a cycle.
            if node.startswith(nxt + ".") or nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _under(module: str, part: str) -> bool:
    full = f"{ROOT}.{part}" if part else ROOT
    return module == full or (bool(part) and module.startswith(full + "."))


def layer_of(module: str) -> str:
    """The layer ``module`` belongs to (``TEST_SUPPORT`` for test support)."""
    if _under(module, TEST_SUPPORT):
        return TEST_SUPPORT
    found = [layer for layer, parts in LAYERS.items() if any(_under(module, p) for p in parts)]
    if len(found) != 1:
        raise KeyError(f"{module} is in {len(found)} layers of LAYERS (it needs one)")
    return found[0]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points to a higher layer, or into test support from outside."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    out = []
    for module, deps in sorted(graph.items()):
        mine = layer_of(module)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if mine == TEST_SUPPORT:
                continue
            if theirs == TEST_SUPPORT:
                out.append(f"{module} ({mine}) imports test support {dep}")
            elif rank[theirs] > rank[mine]:
                out.append(f"{module} ({mine}) imports {dep} ({theirs})")
    return out


def test_no_import_cycles() -> None:
    assert find_cycle(import_graph()) is None, find_cycle(import_graph())


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_follow_the_layers() -> None:
    graph = {m: i.runtime | i.typing for m, i in package_imports().items()}
    assert layer_violations(graph) == []


def test_the_layer_check_finds_upward_imports() -> None:
    def m(part: str) -> str:
        return f"{ROOT}.{part}"

    ok = {m("cache.affine"): {m("ops.quantize"), m("config")}, m("ops.quantize"): set(),
          m("config"): set(), m("eval.loadtest"): {m("apps.server")}, m("apps.server"): set(),
          m("testing.tiny"): {m("eval.loadtest"), ROOT}, ROOT: {m("eval.loadtest")}}
    assert layer_violations(ok) == []
    assert layer_violations({**ok, m("ops.quantize"): {m("config")}}) == [
        f"{m('ops.quantize')} (ops) imports {m('config')} (core)"]
    assert layer_violations({**ok, m("apps.server"): {m("eval.loadtest")}}) == [
        f"{m('apps.server')} (applications) imports {m('eval.loadtest')} (tools)"]
    assert layer_violations({**ok, m("eval.loadtest"): {ROOT}}) == [
        f"{m('eval.loadtest')} (tools) imports {ROOT} (entry points)"]
    assert layer_violations({**ok, ROOT: {m("testing.tiny")}}) == [
        f"{ROOT} (entry points) imports test support {m('testing.tiny')}"]


def test_every_package_module_has_one_layer() -> None:
    for module in package_imports():
        layer_of(module)  # raises for a module of no layer (or of two)


def test_the_graph_reads_dynamic_and_type_checking_imports() -> None:
    modules = {ROOT, f"{ROOT}.cache", f"{ROOT}.cache.a", f"{ROOT}.cache.b", f"{ROOT}.config",
               f"{ROOT}.registry", f"{ROOT}.eval.text"}
    source = '''
import importlib
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig
_PACKAGE = "veloxquant_mlx.cache"
def discover(names, where):
    importlib.import_module(_PACKAGE)
    for n in names:
        importlib.import_module(f"{_PACKAGE}.{n}")
    importlib.import_module("veloxquant_mlx." + "eval.text")
    importlib.import_module(f"mlx_lm.models.{where}")
    importlib.import_module(where)
'''
    got = module_imports(f"{ROOT}.registry", source, False, modules)
    assert got.runtime == {f"{ROOT}.cache", f"{ROOT}.cache.a", f"{ROOT}.cache.b",
                           f"{ROOT}.eval.text"}
    assert got.typing == {f"{ROOT}.config"}
    assert got.unresolved == [13]


def test_dynamic_imports_are_all_read_or_explained() -> None:
    unread = {m for m, i in package_imports().items() if i.unresolved}
    assert unread == set(UNRESOLVED_ALLOWED)


def test_the_registry_discovery_is_in_the_graph() -> None:
    graph = import_graph()
    assert f"{ROOT}.cache.affine" in graph[f"{ROOT}.registry"]


def long_functions() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({n})")
    return out


def test_no_function_is_longer_than_a_screen() -> None:
    assert long_functions() == []


def long_files_without_a_reason(paths: dict[str, str]) -> list[str]:
    """Files (name -> source) over ``MAX_CORE_LINES`` lines whose docstring does not open
    with ``Over 500 lines: <why>``."""
    out = []
    for name, source in sorted(paths.items()):
        if len(source.splitlines()) <= MAX_CORE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        first = doc.splitlines()[0] if doc else ""
        if not (first.startswith(f"Over {MAX_CORE_LINES} lines: ")
                and len(first) > len(f"Over {MAX_CORE_LINES} lines: ") + 10):
            out.append(f"{name} ({len(source.splitlines())} lines)")
    return out


def test_core_files_over_500_lines_say_why() -> None:
    core = {_module_name(p): p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")}
    core = {m: s for m, s in core.items() if layer_of(m) in CORE_LAYERS}
    assert long_files_without_a_reason(core) == []


def test_the_long_file_check_fails_without_a_reason() -> None:
    body = "x = 1\n" * MAX_CORE_LINES
    assert long_files_without_a_reason({"a": f'"""Summary."""\n{body}'}) == ["a (501 lines)"]
    assert long_files_without_a_reason({"a": f'"""Over 500 lines: one state machine."""\n'
                                             f'{body}'}) == []
    assert long_files_without_a_reason({"a": body[: -len("x = 1\n")]}) == []
