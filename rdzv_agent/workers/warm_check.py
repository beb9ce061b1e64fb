"""Can warm workers start an entry point exactly, and gain by it? The check behind warm workers by default.

A warm worker (:mod:`rdzv_agent.workers.warm`) has imported torch before the entry point's first line runs, so
what the entry point does before its own ``import torch`` happens *after* torch's import. That matters when
it changes what the import reads: environment variables (``TORCH_LOGS``, ``OMP_NUM_THREADS`` read by the
OpenMP runtime as it loads, ...), the module search path (another torch), ``dlopen`` flags, warnings
filters. :func:`reason_to_start_cold` reads the entry point's source (never runs it) and finds such a
statement among the top-level statements that precede its first top-level ``import torch``/``from torch...
import``, looking into top-level ``if``/``try``/``with``/``for`` blocks and class bodies but not into function
bodies: a check of what is written at module level, not a proof. An entry point without a module-level torch
import gains nothing it can see from a warm start (a script without torch would only wait for an import it
does not need). For ``-m a.b`` the packages' ``__init__`` files run first and are read too.
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
from typing import Iterator, Sequence

__all__ = ["reason_to_start_cold", "entry_sources"]

#: Calls that change what an import sees: ``module.attr`` names (matched on the last two parts of a call
#: like ``os.environ.setdefault`` -> ``environ.setdefault``).
_CHANGING_CALLS = frozenset({
    "os.putenv", "os.unsetenv", "environ.update", "environ.setdefault", "environ.pop", "environ.popitem",
    "environ.clear", "environ.__setitem__", "environ.__delitem__",
    "path.insert", "path.append", "path.extend", "path.remove", "path.pop", "path.clear",
    "meta_path.insert", "meta_path.append", "path_hooks.insert", "path_hooks.append",
    "site.addsitedir", "sys.setdlopenflags",
    "warnings.filterwarnings", "warnings.simplefilter", "warnings.resetwarnings",
    "load_dotenv", "dotenv.load_dotenv", "ctypes.CDLL", "cdll.LoadLibrary", "ctypes.PyDLL",
})
#: Names whose item or attribute assignment changes what an import sees.
_CHANGING_TARGETS = frozenset({"environ", "path", "meta_path", "path_hooks", "modules"})


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` for a Name/Attribute chain, ``""`` otherwise."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _imports_torch(stmt: ast.AST) -> bool:
    """Whether ``stmt`` imports torch when it runs (also inside a module-level ``try``/``if``/``with``)."""
    for node in _walk_executed(stmt):
        if isinstance(node, ast.Import) and any(a.name == "torch" or a.name.startswith("torch.") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None and \
                (node.module == "torch" or node.module.startswith("torch.")):
            return True
    return False


def _changes(node: ast.AST) -> str | None:
    """What ``node`` (a statement executed at import time, outside function bodies) changes, or ``None``."""
    for sub in _walk_executed(node):
        if isinstance(sub, ast.Call):
            name = _dotted(sub.func)
            if ".".join(name.split(".")[-2:]) in _CHANGING_CALLS:
                return f"calls {name}()"
        targets: list[ast.expr] = []
        if isinstance(sub, (ast.Assign, ast.Delete)):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AugAssign, ast.AnnAssign)):
            targets = [sub.target]
        for target in targets:
            if _changing_target(target):
                return f"assigns to {ast.unparse(target)}"
    return None


def _changing_target(target: ast.expr) -> bool:
    """Is ``target`` ``os.environ[K]``, ``environ[K]``, ``sys.path``, ``sys.path[I]``, ``sys.modules[K]``, ...?"""
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_changing_target(t) for t in target.elts)
    if isinstance(target, ast.Subscript):
        name = _dotted(target.value)
        return name == "environ" or ("." in name and name.split(".")[-1] in _CHANGING_TARGETS)
    if isinstance(target, ast.Attribute):
        return _dotted(target).split(".")[-1] in _CHANGING_TARGETS
    return False


def _walk_executed(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and what it runs at once: of a function or lambda it defines, only the decorators and defaults
    (class bodies run at once)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        runs: list[ast.AST] = [*getattr(node, "decorator_list", []), *node.args.defaults,
                               *(d for d in node.args.kw_defaults if d is not None)]
        for sub in runs:
            yield from _walk_executed(sub)
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _walk_executed(child)


def reason_to_start_cold(sources: Sequence[tuple[str, str]]) -> str | None:
    """Why warm workers should not start this entry point by default, or ``None`` if they can.

    A warm start is exact and useful when the entry point imports torch at module level and changes nothing the
    import reads before that: the first module-level statement that changes the environment, the module search
    path, ``dlopen`` flags or warnings filters is a reason, and so is no module-level ``import torch`` at all
    (nothing would be gained; torch imported inside a function or by another module is not seen).

    Args:
        sources: ``(name, source text)`` in the order they run (:func:`entry_sources`).

    Returns:
        e.g. ``"train.py line 3: calls os.environ.setdefault() before importing torch"``, or ``None``. A source
        that does not parse is ``None`` (the worker fails the same way warm or cold).
    """
    for name, text in sources:
        try:
            tree = ast.parse(text, filename=name)
        except (SyntaxError, ValueError):
            return None
        for stmt in tree.body:
            what = _changes(stmt)  # a statement that imports torch is judged whole (its change may come first)
            if what is not None:
                return f"{name} line {stmt.lineno}: {what} before importing torch"
            if _imports_torch(stmt):
                return None
    return f"{sources[-1][0] if sources else 'the entry point'} does not import torch at module level"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def entry_sources(kind: str, entry: str, path: Sequence[str]) -> list[tuple[str, str]] | None:
    """The sources an entry point runs first, in order, or ``None`` if one cannot be found or read.

    Args:
        kind: ``"script"`` (``entry`` a file), ``"module"`` (``-m entry``) or ``"code"`` (``-c entry``).
        path: the workers' ``sys.path`` (for ``module``).
    """
    if kind == "code":
        return [("-c", entry)]
    if kind == "script":
        text = _read(entry)
        return None if text is None else [(entry, text)]
    found: list[tuple[str, str]] = []
    search: list[str] = list(path)
    parts = entry.split(".")
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), search)
        if spec is None or spec.origin is None or not os.path.isfile(spec.origin):
            return None
        files = [spec.origin]
        if spec.submodule_search_locations is not None and i == len(parts) - 1:  # -m PACKAGE: its __main__
            files.append(os.path.join(os.path.dirname(spec.origin), "__main__.py"))
        for file in files:
            text = _read(file)
            if text is None:
                return None
            found.append((file, text))
        search = list(spec.submodule_search_locations or [])
    return found

