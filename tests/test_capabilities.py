"""Capabilities, not names: shared code asks a method's class, never names the method.

Everything the adapter, the applications, the tools, the rings, the rotation and the
other methods need from a method is a declared capability or hook on its class
(``CompressedCache``: ``attends``, ``hooks_module``, ``drops_front``,
``needs_rotation``, ``precision_ladders``, ... with their defaults; docs/developing.md,
"Adding a method"). So adding a method touches only its own file, its options and its
docs page. This test reads every module of the package (AST) and fails on:

- a string literal equal to a registered method's name (docstrings excluded), outside the
  files of that method's own family (``cache/<module>.py`` and ``cache/<module>_*.py``);
- a read of a method option field through options (``<x>.options.<field>``,
  ``<x>.opts.<field>``, ``options.<field>``, ``opts.<field>``, ``getattr`` / ``hasattr``
  on those), outside the family that declares that field;
- a ``hasattr`` / ``getattr`` probe for an attribute that a method class defines and
  neither the base class nor mlx_lm's own caches have (a capability must be declared,
  with its default), outside that method's family.

The few literals that spell something else that happens to share a method's name are
listed in ``ALLOWED`` with the reason; the list may shrink, never grow. ``compat.py``
describes 0.1's frozen config format, which named 0.1's methods, and is left out.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from veloxquant_mlx.cache.base import CompressedCache
from veloxquant_mlx.registry import methods

PACKAGE = Path(__file__).resolve().parent.parent / "veloxquant_mlx"

# (file, where, literal) -> why that literal there is not a method's name. ``where``:
# the enclosing function, ``<module>`` (outside functions) or ``*`` (the whole file).
_MLX_AFFINE = "MLX's affine quantization mode (mx.quantize), which the method is named after"
ALLOWED: dict[tuple[str, str, str], str] = {
    ("config.py", "parse_value", "none"): "'none' spells Python's None in option strings",
    ("cache/kept.py", "*", "affine"): f"the eviction stores' store='affine': {_MLX_AFFINE}",
    ("cache/turboquant.py", "*", "affine"): f"TurboQuant's quantizer='affine': {_MLX_AFFINE}",
    ("cache/xquant_hook.py", "weight_in_out", "affine"): f"a QuantizedLinear's mode: "
                                                         f"{_MLX_AFFINE}",
    ("testing/architectures.py", "<module>", "none"): "the survey's kind: no attention",
    ("testing/architectures.py", "<module>", "affine"): f"a tiny model's quantization: "
                                                        f"{_MLX_AFFINE}",
}
MAX_ALLOWED = 7
# Option fields a shared module defines itself: the eviction stores' fields, which each
# eviction method embeds in its options and hands to ``cache.kept``.
FIELDS_ALLOWED: dict[str, frozenset[str]] = {
    "cache/kept.py": frozenset({"store", "k_bits", "v_bits", "group_size"}),
}
OPTIONS_NAMES = ("options", "opts")
# 0.1's flat config format as it was (method names included); no new method enters it.
FROZEN = ("compat.py",)


@dataclass(frozen=True)
class Facts:
    """What the check needs to know about the registered methods."""

    # File stem of a method's module -> the method names, option fields and undeclared
    # attributes (defined by its classes, not by the base class) it owns.
    families: dict[str, tuple[frozenset[str], frozenset[str], frozenset[str]]]

    def owner(self, rel: str) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """Method names, option fields and attributes the file ``rel`` may use."""
        path = Path(rel)
        if path.parent.as_posix() == "cache":
            for stem, owned in self.families.items():
                if path.stem == stem or path.stem.startswith(stem + "_"):
                    return owned
        return frozenset(), frozenset(), frozenset()

    def union(self, i: int) -> frozenset[str]:
        return frozenset().union(*(owned[i] for owned in self.families.values()))


def _mlx_lm_cache_attributes() -> set[str]:
    caches = (KVCache(), RotatingKVCache(max_size=8), QuantizedKVCache(), ArraysCache(1))
    return {a for c in caches for a in (*dir(c), *vars(c))}


def registered_facts() -> Facts:
    families: dict[str, tuple[set[str], set[str], set[str]]] = {}
    known = set(dir(CompressedCache)) | _mlx_lm_cache_attributes()
    for name, cls in methods().items():
        stem = cls.__module__.rpartition(".")[2]
        names, fields, attrs = families.setdefault(stem, (set(), set(), set()))
        names.add(name)
        fields.update(cls.Options.field_names())
        for klass in cls.__mro__[:cls.__mro__.index(CompressedCache)]:
            attrs.update(a for a in vars(klass) if not a.startswith("__") and a not in known)
    return Facts({s: tuple(map(frozenset, owned)) for s, owned in families.items()})


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _is_options(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in OPTIONS_NAMES) or \
        (isinstance(node, ast.Name) and node.id in OPTIONS_NAMES)


def _scopes(tree: ast.AST) -> dict[int, str]:
    """Node id -> the name of the innermost function around it (``<module>``: none)."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else scope
            out[id(child)] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return out


def offences(source: str, rel: str, facts: Facts) -> list[tuple[str, str, str]]:
    """``(what, text, where)`` for every name, option-field read and probe in
    ``source`` (``where``: the enclosing function, or ``<module>``)."""
    own_names, own_fields, own_attrs = facts.owner(rel)
    names, undeclared = facts.union(0) - own_names, facts.union(2) - own_attrs
    fields = facts.union(1) - own_fields - FIELDS_ALLOWED.get(rel, frozenset())
    tree = ast.parse(source)
    docs, scopes = _docstrings(tree), _scopes(tree)
    out: list[tuple[str, str, str]] = []
    for node in ast.walk(tree):
        where = scopes.get(id(node), "<module>")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value in names and id(node) not in docs:
            out.append(("name", node.value, where))
        elif isinstance(node, ast.Attribute) and node.attr in fields and \
                _is_options(node.value):
            out.append(("field", ast.unparse(node), where))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant):
            attr = node.args[1].value
            if (attr in fields and _is_options(node.args[0])) or attr in undeclared:
                out.append(("probe", ast.unparse(node), where))
    return out


def _allowed(rel: str, what: str, text: str, where: str) -> bool:
    return what == "name" and any((rel, w, text) in ALLOWED for w in (where, "*"))


def package_offences(facts: Facts) -> list[tuple[str, str, str, str]]:
    """``(file, what, text, where)`` over the package, ``ALLOWED`` names left out."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in FROZEN:
            continue
        out += [(rel, *found) for found in offences(path.read_text(), rel, facts)
                if not _allowed(rel, *found)]
    return out


def test_shared_code_names_no_method_and_reads_no_option_field() -> None:
    found = package_offences(registered_facts())
    assert found == [], ("declare a capability on the method class instead (see "
                         f"docs/developing.md, 'Adding a method'): {found}")


def test_the_allow_list_is_small_and_every_entry_is_needed() -> None:
    assert len(ALLOWED) <= MAX_ALLOWED, "the allow-list may shrink, never grow"
    facts = registered_facts()
    for rel, where, literal in ALLOWED:
        found = offences((PACKAGE / rel).read_text(), rel, facts)
        assert any(f[:2] == ("name", literal) and where in (f[2], "*") for f in found), \
            f"{rel} ({where}) no longer needs {literal!r} allowed: remove the entry"


BAD = '''
"""A module that names "kivi" in its docstring (fine)."""
RING = {"kivi": 1}


def f(config, opts):
    """Neither does "xquant" here."""
    if config.method == "xquant":
        return config.options.latent + opts.window
    return hasattr(type(config), "update_x") or getattr(config.options, "pre_rope", False)
'''


def test_a_bad_module_is_caught() -> None:
    facts = registered_facts()
    got = offences(BAD, "apps/bad.py", facts)
    assert sorted(got) == sorted([
        ("name", "kivi", "<module>"), ("name", "xquant", "f"),
        ("field", "config.options.latent", "f"), ("field", "opts.window", "f"),
        ("probe", "hasattr(type(config), 'update_x')", "f"),
        ("probe", "getattr(config.options, 'pre_rope', False)", "f")])
    # The same code in the method's own family names only what it owns.
    in_family = [f[:2] for f in offences(BAD, "cache/xquant_hook.py", facts)]
    assert ("name", "xquant") not in in_family and ("name", "kivi") in in_family
    assert ("field", "config.options.latent") not in in_family
    assert ("probe", "hasattr(type(config), 'update_x')") not in in_family
    # An allowed literal is allowed where it is listed only.
    assert _allowed("config.py", "name", "none", "parse_value")
    assert not _allowed("config.py", "name", "none", "from_dict")


def test_every_capability_has_a_default_on_the_base_class() -> None:
    # A method that declares nothing runs with the base class's defaults.
    base = CompressedCache
    assert (base.profile.hooks_module, base.profile.drops_front, base.profile.min_layers) == (False, False, 1)
    assert base.profile.ring_alignment(None) == 1 and base.profile.ladders == {}
    assert base.profile.needs_rotation(None) is False and base.profile.rotation_refusal(None) is None
    assert base.profile.replicated(None, 8, 16) is None
    assert base.profile.curve_tags(None) == []
    assert base.profile.small == base.profile.lossless == base.profile.few_layer == {}
