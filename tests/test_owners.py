"""Each piece of state has one writer: a slot's recorded content only ``runtime.kvcache``, its
leases only ``runtime.gateway``.

The scan reads every module of ``src/`` and finds calls of ``SlotManager``'s writing methods.
The content writers have names no other class in ``src/`` uses, so any call of them counts; the
lease writers (``acquire``, ``release``, ``sweep``, ``touch``) share their names with the
gateway's own methods, so only calls on a slot table (an expression ending in ``slots``) count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attrs

from agentkv.slots import SlotManager

SRC = Path(__file__).resolve().parent.parent / "src"
KVCACHE = SRC / "agentkv" / "runtime" / "kvcache.py"
GATEWAY = SRC / "agentkv" / "runtime" / "gateway.py"
SLOTS = SRC / "agentkv" / "slots.py"

#: What a slot holds (its tokens, its store entry, its prompt sections).
#: ``take_out``/``bring_back`` (a pool's engine left or rejoined) forget what the slots held.
CONTENT_WRITERS = frozenset(
    {"set_content", "mark_stored", "forget_entry", "invalidate", "take_out", "bring_back"}
)
#: Who holds a slot. ``release`` also takes what the slot holds when its lease ends: the lease's
#: holder states it, the gateway passes it on with the lease.
LEASE_WRITERS = frozenset({"acquire", "release", "sweep", "touch"})
READERS = frozenset({"idle", "place", "lease", "table", "stats", "free", "is_out"})


def _receiver(node: ast.expr) -> str:
    """The last name of a call's receiver: ``slots`` for ``self.gateway.slots.invalidate``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def writes(source: str) -> list[tuple[int, str, str]]:
    """(line, method, kind) of every call of a ``SlotManager`` writer in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        method = node.func.attr
        if method in CONTENT_WRITERS:
            found.append((node.lineno, method, "content"))
        elif method in LEASE_WRITERS and _receiver(node.func.value).endswith("slots"):
            found.append((node.lineno, method, "lease"))
    return found


def _violations() -> list[str]:
    owner = {"content": KVCACHE, "lease": GATEWAY}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SLOTS:
            continue
        for line, method, kind in writes(path.read_text(encoding="utf-8")):
            if path != owner[kind]:
                where = path.relative_to(SRC)
                found.append(f"{where}:{line}: {method}() writes slot {kind}s")
    return found


def test_every_slot_manager_method_is_known_as_reader_or_writer() -> None:
    """A new SlotManager method must be classified here, so the scan below covers it."""
    fields = {field.name for field in attrs.fields(SlotManager)}
    public = {name for name in dir(SlotManager) if not name.startswith("_")} - fields
    assert public == CONTENT_WRITERS | LEASE_WRITERS | READERS


def test_content_writers_have_names_only_the_slot_table_uses() -> None:
    """No other class in src/ defines a method of the same name, so a call of one is a write."""
    for path in SRC.rglob("*.py"):
        if path == SLOTS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.name not in CONTENT_WRITERS, f"{path}: def {node.name}"


def test_only_the_owners_write_slot_state() -> None:
    """Slot contents are written only by runtime.kvcache, leases only by runtime.gateway."""
    assert _violations() == []
    # The owners do write (the scan sees their calls).
    kinds = {kind for _, _, kind in writes(KVCACHE.read_text(encoding="utf-8"))}
    assert kinds == {"content"}
    assert {m for _, m, _ in writes(GATEWAY.read_text(encoding="utf-8"))} == LEASE_WRITERS


def test_the_scan_finds_a_planted_write() -> None:
    """Writes through an alias or a long attribute chain are found; a gateway's own release is
    not a slot-table call."""
    planted = (
        "def use(runtime, lease):\n"
        "    manager = runtime.gateway.slots\n"
        "    manager.invalidate(lease.slot)\n"
        "    runtime.gateway.slots.set_content(0, ())\n"
        "    runtime.gateway._slots.release(lease, 0.0, holds=None)\n"
        "    runtime.gateway.release(lease, holds=None)\n"
    )
    assert writes(planted) == [
        (3, "invalidate", "content"),
        (4, "set_content", "content"),
        (5, "release", "lease"),
    ]


#: No module of ``src/`` grows past this many lines; the request's script stays short. (The
#: dispatcher is at 816 with the rule that short prefills go one after the other; the split of
#: its state by owner is the next step, not a cut to fit this number.)
MAX_MODULE_LINES = 820
MAX_LIFECYCLE_LINES = 450


def test_no_module_outgrows_its_bound() -> None:
    sizes = {
        path.relative_to(SRC).as_posix(): len(path.read_text("utf-8").splitlines())
        for path in SRC.rglob("*.py")
    }
    assert sizes, SRC
    too_long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_long, too_long
    assert sizes["agentkv/runtime/lifecycle.py"] <= MAX_LIFECYCLE_LINES
