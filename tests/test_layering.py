"""The source tree keeps its layers: no import cycles, no arrows up (tests/ and benchmarks/ excepted).

Layers, bottom to top: the engine (everything in ``fsdp_plugin`` outside the groups below); ``checkpoint``
and ``planner`` side by side (neither imports the other); the public facade (``fsdp_plugin/__init__.py``, ``api.py``), ``integrations`` (users of the public
API) and the ``fsdp-plugin`` command line (``cli.py``), which may import anything. The one arrow up is listed in
``ALLOWED`` with its reason. Every import counts, at module level or inside a function (a lazy import
that closes a cycle is still a cycle), except those under ``if TYPE_CHECKING:``.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FACADE = {"fsdp_plugin", "fsdp_plugin.api"}
LAYER = {"engine": 0, "checkpoint": 1, "planner": 1, "facade": 2, "integrations": 3, "cli": 4}
ALLOWED = {
    # `import fsdp_plugin` registers "fsdp_plugin" in Lightning's registries; the module never imports Lightning
    ("fsdp_plugin", "fsdp_plugin.integrations.lightning._register"),
    # a sharded PEFT/transformers root's own model.save_pretrained (issue 56) runs the integrations' ranged save:
    # imported inside the call, long after `import fsdp_plugin`; one implementation for both entry points
    ("fsdp_plugin._build.library_save", "fsdp_plugin.integrations._ranged_save"),
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for base, name in ((ROOT / "fsdp_plugin", "fsdp_plugin"), (ROOT / "integrations", "fsdp_plugin.integrations")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = path
    return out


MODULES = _modules()


def layer(mod: str) -> str:
    if mod in FACADE:
        return "facade"
    if mod == "fsdp_plugin.cli":
        return "cli"
    for group in ("integrations", "checkpoint", "planner"):
        if mod == f"fsdp_plugin.{group}" or mod.startswith(f"fsdp_plugin.{group}."):
            return group
    return "engine"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(mod: str, path: pathlib.Path) -> set[str]:
    is_pkg = path.name == "__init__.py"
    package = mod.split(".") if is_pkg else mod.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in child.names} & MODULES.keys()
                found.update(subs)
                if len(subs) < len(child.names):
                    found.add(base)  # names defined in the module `base` itself
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in MODULES and m != mod}


GRAPH = {mod: _imports(mod, path) for mod, path in MODULES.items()}


def _siblings(a: str, b: str) -> bool:
    """checkpoint and planner stand side by side above the engine: neither imports the other."""
    return layer(a) != layer(b) and LAYER[layer(a)] == LAYER[layer(b)]


def _up_arrows(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, deps in graph.items() for b in deps
            if (LAYER[layer(b)] > LAYER[layer(a)] or _siblings(a, b)) and (a, b) not in ALLOWED]


def test_no_arrow_runs_up_the_layers():
    bad = _up_arrows(GRAPH)
    assert not bad, "imports that run up the layers:\n" + "\n".join(sorted(bad))


def test_the_planner_uses_no_engine_private_name():
    bad = []
    for mod, path in MODULES.items():
        if layer(mod) != "planner":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and not (node.module or "").startswith("planner"):
                base = f"fsdp_plugin.{node.module}." if node.module else "fsdp_plugin."   # ``from .. import _x``
                bad += [f"{mod}: {base}{a.name}" for a in node.names if a.name.startswith("_")
                        and f"{base}{a.name}" not in MODULES]
    assert not bad, "the planner imports private engine names:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if (v, w) in ALLOWED:  # runs only after `import fsdp_plugin` has finished
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def _package_of(mod: str) -> str:
    return mod if MODULES[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]


def _real_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    # a package's __init__ re-exporting its own modules is not a cycle of the architecture
    return [c for c in _cycles(graph)
            if not all(m == _package_of(c[0]) or _package_of(m) == _package_of(c[0]) for m in c)
            or not any(MODULES[m].name == "__init__.py" for m in c)]


def test_no_import_cycle():
    cycles = _real_cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_violations():
    assert "fsdp_plugin._comm.collectives" in GRAPH["fsdp_plugin._flat.flat_param"]
    bad = {m: set(d) for m, d in GRAPH.items()}
    bad["fsdp_plugin._comm.collectives"].add("fsdp_plugin.checkpoint.save")        # engine -> checkpoint
    bad["fsdp_plugin.planner.api"].add("fsdp_plugin.checkpoint.hf.hf_out")            # sibling -> sibling
    bad["fsdp_plugin._comm.collectives"].add("fsdp_plugin._flat.flat_param")       # closes a cycle
    assert len(_up_arrows(bad)) == 2
    assert any("fsdp_plugin._comm.collectives" in c for c in _real_cycles(bad))
