"""Each setting's default is written in one place.

The runtime's and the server's settings (``RuntimeConfig``, ``ServerConfig``) are what a user sets.
A component that has a field of the same name takes the config value or imports the default from
where it is written; it does not write the number again, which is how defaults drift apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
#: Fields named like a setting that mean something else: the engine's own address (agentkv's own
#: is ``ServerConfig.host``/``port``).
OTHER_MEANING = {"EngineConfig": {"host", "port"}, "ExactArgs": {"host", "port"}}
CONFIGS = {
    SRC / "agentkv" / "runtime" / "config.py": "RuntimeConfig",
    SRC / "agentkv_server" / "config.py": "ServerConfig",
}


def _literal(node: ast.expr | None) -> bool:
    """Whether a default is written out (a number or string, possibly signed or multiplied)."""
    if isinstance(node, ast.Constant):
        return node.value is not None and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    return False


def _default(value: ast.expr | None) -> ast.expr | None:
    """The default a field's right-hand side gives: ``x``, ``attrs.field(default=x)``,
    ``setting(x, …)``."""
    if isinstance(value, ast.Call):
        for keyword in value.keywords:
            if keyword.arg == "default":
                return keyword.value
        name = value.func.id if isinstance(value.func, ast.Name) else ""
        return value.args[0] if name == "setting" and value.args else None
    return value


def _fields(path: Path) -> list[tuple[str, str, int, bool]]:
    """(class, field, line, default written out) for every annotated class field in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    literal = _literal(_default(item.value))
                    found.append((node.name, item.target.id, item.lineno, literal))
    return found


def test_no_setting_default_is_written_twice() -> None:
    """No class outside the configs writes out a default for a field named like a setting."""
    settings = {
        name
        for path, cls in CONFIGS.items()
        for owner, name, _, _ in _fields(path)
        if owner == cls and not name.startswith("_")
    }
    assert len(settings) > 20
    twice = [
        f"{path.relative_to(SRC)}:{line} {owner}.{name}"
        for path in SRC.rglob("*.py")
        if path not in CONFIGS
        for owner, name, line, literal in _fields(path)
        if literal and name in settings and name not in OTHER_MEANING.get(owner, ())
    ]
    assert twice == []
