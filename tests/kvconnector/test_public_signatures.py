"""No `Any` in the public signatures of kvprotocol and kvconnector (issue #41 item 6).

Read from the sources (ast), so kvconnector.vllm is covered without vLLM installed. Public is:
a non-underscore function, class, method (or `__init__`/`__call__`), class field or module-level
alias in a module whose path has no underscore part, plus what a package's `__init__` re-exports
from a private module (`from ._x import Name`; `from . import _x as name`: all of `_x`). An annotation that
names `Any` (`Any`, `typing.Any`, inside `dict[str, Any]`, ...) fails unless ALLOWED lists it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "packages"
PACKAGES = {
    "kvprotocol": ROOT / "kvprotocol" / "src" / "kvprotocol",
    "kvconnector": ROOT / "kvconnector" / "src" / "kvconnector",
}

# "module:qualname(:param)" -> why Any is the contract there. Keep it short.
ALLOWED: dict[str, str] = {
    "kvprotocol._client:Reply.result": "the untyped `call` path: the decoded msgpack map of any op (`send` is typed)",
    "kvconnector.vllm.connector:KVServerConnector.start_load_kv:**kwargs": "KVConnectorBase_V1's signature",
    "kvconnector.vllm.connector:KVServerConnector.save_kv_layer:**kwargs": "KVConnectorBase_V1's signature",
    "kvconnector.vllm.ec_connector:KVServerECConnector.start_load_caches:**kwargs": "ECConnectorBase's signature",
    "kvconnector.vllm.ec_connector:KVServerECConnector.save_caches:**kwargs": "ECConnectorBase's signature",
    # (LoadJob, LoadOutcome) | (SaveJob, SaveOutcome) pairs: worker.py's loop needs narrowing per pair;
    # left for the streaming-load rework of loader.py / worker.py.
    "kvconnector.vllm.loader:BackgroundLoader.take_done:return": "job/outcome pairs (see above)",
}


def _module_name(pkg: str, root: Path, path: Path) -> str:
    parts = [pkg, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_public_module(name: str) -> bool:
    return not any(p.startswith("_") for p in name.split("."))


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _sources() -> dict[str, tuple[Path, ast.Module]]:
    out: dict[str, tuple[Path, ast.Module]] = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            out[_module_name(pkg, root, path)] = (path, ast.parse(path.read_text(), str(path)))
    return out


def _exports(sources: dict[str, tuple[Path, ast.Module]]) -> tuple[set[str], dict[str, set[str]]]:
    """(private modules public as a whole, {private module: names re-exported by a public module})."""
    whole: set[str] = set()
    names: dict[str, set[str]] = {}
    for mod, (path, tree) in sources.items():
        is_package = path.name == "__init__.py"
        if not _is_public_module(mod) or not is_package:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            target = _resolve(mod, is_package, node.level, node.module)
            for alias in node.names:
                if node.module is None and alias.name.startswith("_") and alias.asname and alias.asname[0] != "_":
                    whole.add(f"{target}.{alias.name}")  # from . import _flows as flows
                elif node.module is not None and not _is_public_module(target) and not alias.name.startswith("_"):
                    names.setdefault(target, set()).add(alias.name)
    return whole, names


def _names_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
            try:
                if _names_any(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
    return False


def _public_member(name: str) -> bool:
    return not name.startswith("_") or name in ("__init__", "__call__", "__getattr__")


def _function_hits(where: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[str]:
    a = fn.args
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
        if _names_any(arg.annotation):
            yield f"{where}:{arg.arg}"
    if a.vararg is not None and _names_any(a.vararg.annotation):
        yield f"{where}:*{a.vararg.arg}"
    if a.kwarg is not None and _names_any(a.kwarg.annotation):
        yield f"{where}:**{a.kwarg.arg}"
    if _names_any(fn.returns):
        yield f"{where}:return"


def _class_hits(where: str, cls: ast.ClassDef) -> Iterator[str]:
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public_member(item.name):
            yield from _function_hits(f"{where}.{item.name}", item)
        elif (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and not item.target.id.startswith("_")
            and _names_any(item.annotation)
        ):
            yield f"{where}.{item.target.id}"


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, those of its `if TYPE_CHECKING:` (any top-level if) blocks included."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        else:
            yield node


def _module_hits(mod: str, tree: ast.Module, only: set[str] | None) -> Iterator[str]:
    for node in _top_level(tree.body):
        name = getattr(node, "name", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            tnames = [t.id for t in targets if isinstance(t, ast.Name)]
            annotated = isinstance(node, ast.AnnAssign) and _names_any(node.annotation)
            aliased = node.value is not None and _names_any(node.value)  # an alias: X = dict[str, Any]
            if not tnames or not (annotated or aliased):
                continue
            name = tnames[0]
            if not name.startswith("_") and (only is None or name in only):
                yield f"{mod}:{name}"
            continue
        if name is None or not _public_member(name) or (only is not None and name not in only):
            continue
        if name == "__getattr__" and only is not None:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _function_hits(f"{mod}:{name}", node)
        elif isinstance(node, ast.ClassDef):
            yield from _class_hits(f"{mod}:{name}", node)


def public_any() -> list[str]:
    sources = _sources()
    whole, names = _exports(sources)
    hits: list[str] = []
    for mod, (_, tree) in sources.items():
        if _is_public_module(mod) or mod in whole:
            hits.extend(_module_hits(mod, tree, None))
        elif mod in names:
            hits.extend(_module_hits(mod, tree, names[mod]))
    return hits


def test_no_any_in_public_signatures() -> None:
    found = public_any()
    unexpected = [h for h in found if h not in ALLOWED]
    assert not unexpected, "Any in public signatures (type them, or allow-list with a reason):\n" + "\n".join(
        unexpected
    )


def test_allow_list_has_no_stale_entries() -> None:
    stale = sorted(set(ALLOWED) - set(public_any()))
    assert not stale, f"ALLOWED names signatures without Any now: {stale}"


def test_the_scan_sees_a_new_any(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan fails on an Any added to a public signature (and to a re-exported private one)."""
    for pkg, root in PACKAGES.items():
        copy = tmp_path / pkg
        for path in root.rglob("*.py"):
            dst = copy / path.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(path.read_text())
        monkeypatch.setitem(PACKAGES, pkg, copy)
    (tmp_path / "kvconnector" / "vllm" / "plan.py").write_text(
        "from typing import TYPE_CHECKING, Any\n\n"
        "if TYPE_CHECKING:\n    Alias = list[Any]\n\n"
        "def f(x: dict[str, Any]) -> None: ...\n\n"
        "class C:\n    field: Any\n\n    def m(self, *a: int, **k: Any) -> typing.Any: ...\n\n"
        "def _private(x: Any) -> Any: ...\n",
        encoding="utf-8",
    )
    with (tmp_path / "kvprotocol" / "_keys.py").open("a") as f:
        f.write("\n\ndef validate_salt(salt: 'Any') -> str: ...\n")  # exported by kvprotocol/__init__
    with (tmp_path / "kvprotocol" / "_replies.py").open("a") as f:
        f.write("\n\nclass NewReply(Reply_):\n    x: list[Any]\n")  # `replies` is exported whole
    with (tmp_path / "kvconnector" / "_link.py").open("a") as f:
        f.write("\n\ndef internal(x: Any) -> None: ...\n")  # a private module no __init__ exports
    found = public_any()
    for hit in (
        "kvconnector.vllm.plan:Alias",
        "kvconnector.vllm.plan:f:x",
        "kvconnector.vllm.plan:C.field",
        "kvconnector.vllm.plan:C.m:**k",
        "kvconnector.vllm.plan:C.m:return",
        "kvprotocol._keys:validate_salt:salt",
        "kvprotocol._replies:NewReply.x",
    ):
        assert hit in found
    assert not [h for h in found if "_private" in h or h.startswith("kvconnector._link")]
    with pytest.raises(AssertionError, match=re.escape("kvconnector.vllm.plan:f:x")):
        test_no_any_in_public_signatures()
