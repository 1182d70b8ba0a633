"""The supported mlx/mlx-lm range (one place, the same in pyproject.toml, checked at
import) and the list of mlx_lm's private names the package uses (complete, and all
present in the installed mlx_lm)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest
import tomllib

from veloxquant_mlx import deps
from veloxquant_mlx.mlx_lm_private import (
    PRIVATE_NAMES,
    class_private_names,
    has_private_name,
    missing_private_names,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "veloxquant_mlx"


# ---------------------------------------------------------------- the version range
def _pyproject_specs() -> dict[str, set[str]]:
    """Each mlx / mlx-lm requirement's version clauses, by distribution name."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out: dict[str, set[str]] = {}
    for req in data["project"]["dependencies"]:
        head = req.split(";")[0].replace(" ", "")
        name = head.split("[")[0].split(">")[0].split("<")[0].split("=")[0]
        if name in deps.SUPPORTED:
            spec = head[len(name):].split("]")[-1]
            out.setdefault(name, set()).add(",".join(sorted(spec.split(","))))
    return out


def test_pyproject_states_the_supported_range():
    specs = _pyproject_specs()
    # mlx appears twice (Darwin, mlx[cpu] elsewhere): both carry the one range.
    assert specs == {n: {",".join(sorted(s.split(",")))} for n, s in deps.SUPPORTED.items()}
    for spec in deps.SUPPORTED.values():
        assert ">=" in spec and "<" in spec.replace("<=", ""), spec  # both bounds


def test_installed_versions_are_supported():
    assert deps.version_problems(deps.installed_versions()) == []


@pytest.mark.parametrize(("version", "spec", "ok"), [
    ("0.32.2", ">=0.32.2,<0.33", True), ("0.32.10", ">=0.32.2,<0.33", True),
    ("0.32.1", ">=0.32.2,<0.33", False), ("0.33.0", ">=0.32.2,<0.33", False),
    ("0.33.0.dev20260101", ">=0.32.2,<0.33", False), ("0.32.4rc1", ">=0.32.0,<0.33", True),
    ("1.0", ">=0.32.0,<0.33", False),
])
def test_in_range(version, spec, ok):
    assert deps.in_range(version, spec) is ok


def test_bad_specs_and_versions_are_named():
    with pytest.raises(ValueError, match="'~=1.0'"):
        deps.in_range("1.0", "~=1.0")
    with pytest.raises(ValueError, match="'banana'"):
        deps.parse_version("banana")


def test_check_names_installed_and_supported_versions():
    ok = {"mlx": "0.32.4", "mlx-lm": "0.32.2"}
    deps.check_versions(ok, environ={})
    for bad, said in [({"mlx-lm": "0.31.3"}, "mlx-lm 0.31.3 is installed; supported: "
                       "mlx-lm>=0.32.0,<0.33"),
                      ({"mlx": "0.33.1"}, "mlx 0.33.1 is installed; supported: mlx>=0.32.2"),
                      ({"mlx-lm": None}, "mlx-lm is not installed")]:
        with pytest.raises(ImportError) as err:
            deps.check_versions({**ok, **bad}, environ={})
        assert said in str(err.value) and deps.ENV_ALLOW in str(err.value)
        with pytest.warns(RuntimeWarning, match=said.split(" is")[0]):
            deps.check_versions({**ok, **bad}, environ={deps.ENV_ALLOW: "1"})


def test_import_refuses_an_unsupported_mlx_lm():
    # A real import in a fresh process, with mlx-lm's installed version reported as 0.31.3.
    code = ("import importlib.metadata as m; v = m.version\n"
            "m.version = lambda n: '0.31.3' if n == 'mlx-lm' else v(n)\n"
            "try:\n import veloxquant_mlx\nexcept ImportError as e:\n print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != deps.ENV_ALLOW}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert "REFUSED veloxquant_mlx: mlx-lm 0.31.3 is installed" in out.stdout, out.stderr
    # The check runs before mlx_lm is imported: the error is the first thing to fail.
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------- listed private names
def test_every_listed_private_name_exists_in_the_installed_mlx_lm():
    assert missing_private_names() == []
    assert len({(m, n) for m, n, _ in PRIVATE_NAMES}) == len(PRIVATE_NAMES)
    assert all(len(why.split()) >= 3 for _, _, why in PRIVATE_NAMES)


def test_a_vanished_private_name_is_reported(monkeypatch):
    # mlx_lm.generate is also mlx_lm's generate function: take the modules themselves.
    generate = importlib.import_module("mlx_lm.generate")
    server = importlib.import_module("mlx_lm.server")
    monkeypatch.delattr(server, "_run_http_server")

    class Renamed:  # BatchGenerator's shape in a release that renamed _next
        def step(self) -> None:
            self._prompt_batch = None

    monkeypatch.setattr(generate, "BatchGenerator", Renamed)
    missing = missing_private_names()
    assert "mlx_lm.server:_run_http_server" in missing
    assert "mlx_lm.generate:BatchGenerator._next" in missing
    assert not has_private_name("mlx_lm.server", "ResponseGenerator._no_such_member")
    assert not has_private_name("mlx_lm.no_such_module", "_x")


# ---------------------------------------------------------------- the source scan
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _mlx_lm_owners() -> dict[str, set[tuple[str, str]]]:
    """Every private member of every mlx_lm class, read from mlx_lm's source files:
    name -> {(module, "Class.name")}."""
    root = Path(mlx_lm.__file__).parent
    owners: dict[str, set[tuple[str, str]]] = {}

    def visit(body: list[ast.stmt], module: str, prefix: str) -> None:
        for node in body:
            if not isinstance(node, ast.ClassDef):
                continue
            qual = prefix + node.name
            for item in node.body:
                names = {item.name} if isinstance(item, ast.FunctionDef) else set()
                names |= {s.attr for s in ast.walk(item) if isinstance(s, ast.Attribute)
                          and isinstance(s.value, ast.Name) and s.value.id == "self"}
                for n in filter(_private, names):
                    owners.setdefault(n, set()).add((module, f"{qual}.{n}"))
            visit(node.body, module, qual + ".")

    for f in root.rglob("*.py"):
        rel = f.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        visit(ast.parse(f.read_text()).body, module, "")
    return owners


class _Scan:
    """The private mlx_lm names one source file reaches; each use is the tuple of
    ``(module, name)`` that may own it (one of them must be listed)."""

    def __init__(self, source: str, owners: dict[str, set[tuple[str, str]]]) -> None:
        self.tree, self.owners = ast.parse(source), owners
        self.aliases: dict[str, tuple[str, str | None]] = {}  # local -> (module, qualname)
        self.package: dict[str, tuple[str, str]] = {}  # local -> (package module, name)
        self.uses: list[tuple[tuple[str, str], ...]] = []
        self._imports()
        self._classes()
        self._others()

    def _imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "mlx_lm":
                        local = a.asname or "mlx_lm"
                        self.aliases[local] = (a.name if a.asname else "mlx_lm", None)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    local = a.asname or a.name
                    if node.module.split(".")[0] == "veloxquant_mlx":
                        self.package[local] = (node.module, a.name)
                    elif node.module.split(".")[0] == "mlx_lm":
                        self.aliases[local] = self._member(node.module, None, a.name)
                        if _private(a.name):
                            self.uses.append(((node.module, a.name),))

    @staticmethod
    def _member(module: str, qual: str | None, name: str) -> tuple[str, str | None]:
        if qual is None:
            try:
                importlib.import_module(f"{module}.{name}")
                return f"{module}.{name}", None
            except ImportError:
                return module, name
        return module, f"{qual}.{name}"

    def _resolve(self, expr: ast.expr) -> tuple[str, str | None] | None:
        if isinstance(expr, ast.Name):
            return self.aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            inner = self._resolve(expr.value)
            return None if inner is None else self._member(*inner, expr.attr)
        return None

    def _ancestors(self, node: ast.ClassDef, local: dict[str, list[type]]) -> list[type]:
        out: list[type] = []
        for base in node.bases:
            r, cls = self._resolve(base), None
            if r is not None and r[1] is not None:
                cls = importlib.import_module(r[0])
                for part in r[1].split("."):
                    cls = getattr(cls, part)
            elif isinstance(base, ast.Name) and base.id in local:
                out += local[base.id]
            elif isinstance(base, ast.Name) and base.id in self.package:
                module, name = self.package[base.id]
                cls = getattr(importlib.import_module(module), name)
            if inspect.isclass(cls):
                out += [k for k in inspect.getmro(cls) if k.__module__.startswith("mlx_lm")]
        return out

    def _classes(self) -> None:
        local: dict[str, list[type]] = {}
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.ClassDef) or not (anc := self._ancestors(node, local)):
                continue
            local[node.name] = anc
            names = [i.name for i in node.body if isinstance(i, ast.FunctionDef)]
            for sub in ast.walk(node):
                v = sub.value if isinstance(sub, ast.Attribute) else None
                if (isinstance(v, ast.Name) and v.id in ("self", "cls")) or (
                        isinstance(v, ast.Call) and getattr(v.func, "id", "") == "super"):
                    names.append(sub.attr)
            for n in filter(_private, names):
                found = tuple((k.__module__, f"{k.__qualname__}.{n}") for k in anc
                              if n in class_private_names(k))
                if found:
                    self.uses.append(found)

    def _others(self) -> None:
        for sub in ast.walk(self.tree):
            name = None
            if isinstance(sub, ast.Attribute) and _private(sub.attr):
                r = self._resolve(sub.value)
                if r is not None:
                    self.uses.append(((r[0], f"{r[1]}.{sub.attr}" if r[1] else sub.attr),))
                    continue
                v = sub.value
                if not ((isinstance(v, ast.Name) and v.id in ("self", "cls"))
                        or (isinstance(v, ast.Call) and getattr(v.func, "id", "") == "super")):
                    name = sub.attr
            elif (isinstance(sub, ast.Call) and getattr(sub.func, "id", "") in
                  ("getattr", "setattr", "hasattr", "delattr") and len(sub.args) > 1
                  and isinstance(sub.args[1], ast.Constant) and isinstance(sub.args[1].value, str)):
                name = sub.args[1].value
            if name in self.owners:
                self.uses.append(tuple(sorted(self.owners[name])))


@pytest.fixture(scope="module")
def owners() -> dict[str, set[tuple[str, str]]]:
    return _mlx_lm_owners()


def test_the_package_uses_no_unlisted_private_mlx_lm_name(owners):
    listed = {(m, n) for m, n, _ in PRIVATE_NAMES}
    unlisted, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for use in _Scan(path.read_text(), owners).uses:
            used |= set(use) & listed
            if not set(use) & listed:
                unlisted.append(f"{path.relative_to(ROOT)}: {' or '.join(map(str, use))}")
    assert not unlisted, "add to mlx_lm_private.PRIVATE_NAMES:\n" + "\n".join(unlisted)
    # And nothing listed that the package no longer uses: the list stays the truth.
    assert listed - used == set()


def test_the_scan_finds_each_kind_of_use(owners):
    source = (
        "from mlx_lm import server as s\n"
        "from mlx_lm.models.cache import _BaseCache\n"
        "s._make_sampler(None, None)\n"
        "class G(s.ResponseGenerator):\n"
        "    def _serve_single(self):\n"
        "        return self._rank, self._mine\n"
        "def f(gen):\n"
        "    return gen._share_object, getattr(gen, '_stop')\n"
    )
    uses = {u for use in _Scan(source, owners).uses for u in use}
    for want in [("mlx_lm.server", "_make_sampler"), ("mlx_lm.models.cache", "_BaseCache"),
                 ("mlx_lm.server", "ResponseGenerator._serve_single"),
                 ("mlx_lm.server", "ResponseGenerator._rank"),
                 ("mlx_lm.server", "ResponseGenerator._share_object"),
                 ("mlx_lm.server", "ResponseGenerator._stop")]:
        assert want in uses, want
    assert not any(n.endswith("._mine") for _, n in uses)  # the subclass's own attribute
