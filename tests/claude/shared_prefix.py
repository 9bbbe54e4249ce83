"""How much of Claude Code's first request two projects share, in llama-server's own tokens.

``python -m tests.claude.shared_prefix`` starts llama-server with the default model (one slot of
32,768 tokens, no host prompt cache) and translates the captured first requests in
``tests/fixtures/claude_code/projects`` (``python -m tests.claude.capture`` writes them): for
every pair of one kind (``-p`` agents, sub-agents, the interactive CLI) it prints the tokens the
two prompts share, with the session layout and without it (``--no-session-layout``). Then it
sends the reference capture (``git_demo``) to the slot and, after it, each other ``-p`` capture
(the reference again in between), and prints llama-server's ``cache_n`` and ``prompt_n`` for
each: what the engine itself reused.

The figures in docs/claude-code.md and docs/scheduling.md come from this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import anyio
import httpx

from agentkv import MessagesTranslator
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, find_llama_server
from agentkv.runtime.model import default_model_path
from agentkv.tokens import common_prefix
from tests.claude._cli import temporary_root

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "claude_code"
CAPTURES = FIXTURES / "projects"
REFERENCE = "git_demo"
_OTHER = ("subagent_", "interactive_")
#: Pairs of the first captures (fixtures README): same project, a file task, another directory.
EARLIER_PAIRS = (
    ("a_one_word", "c_same_project_1"),
    ("a_one_word", "b_file_task_1"),
    ("a_one_word", "d_other_project"),
)


def _captures() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text())["body"] for p in sorted(CAPTURES.glob("*.json"))}


def _kind(name: str) -> str:
    return next((k for k in _OTHER if name.startswith(k)), "p")


def _earlier() -> dict[str, dict[str, Any]]:
    names = {name for pair in EARLIER_PAIRS for name in pair}
    return {n: json.loads((FIXTURES / f"{n}.json").read_text())["body"] for n in sorted(names)}


async def _measure(engine_runs: bool) -> dict[str, Any]:
    captures = _captures()
    out: dict[str, Any] = {"pairs": [], "engine": []}
    with temporary_root("agentkv-shared-") as root:
        config = EngineConfig(
            model=default_model_path(),
            slots=1,
            ctx_per_slot=32768,
            port=0,
            cache_ram_mib=0,
        )
        async with LlamaServerProcess(
            config, binary=find_llama_server(), log_dir=root, startup_timeout=300
        ) as process:
            client = process.client(read_timeout=1800)
            try:
                tokens: dict[tuple[str, bool], list[int]] = {}
                everything = {**captures, **_earlier()}
                for layout in (True, False):
                    translator = MessagesTranslator(session_layout=layout)
                    for name, body in everything.items():
                        engine = translator.translate(body)
                        tokens[name, layout] = await client.prompt_tokens(engine.body)
                pairs = [
                    (a, b) for a, b in itertools.combinations(captures, 2) if _kind(a) == _kind(b)
                ]
                for a, b in [*pairs, *EARLIER_PAIRS]:
                    row: dict[str, Any] = {"a": a, "b": b}
                    for layout, key in ((True, "layout"), (False, "as_sent")):
                        ta, tb = tokens[a, layout], tokens[b, layout]
                        row[key] = {"shared": common_prefix(ta, tb), "of": len(tb)}
                    out["pairs"].append(row)
                    print(json.dumps(row), flush=True)
                if engine_runs:
                    async with httpx.AsyncClient(
                        base_url=process.base_url, headers=process.headers, timeout=1800
                    ) as http:
                        out["engine"] = await _engine_runs(http, captures)
            finally:
                await client.aclose()
    return out


async def _engine_runs(
    http: httpx.AsyncClient, captures: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The reference capture, then each other one with the reference again before it: what
    llama-server reused for each (``cache_n``) right after the reference."""
    translator = MessagesTranslator()
    rows = []
    reference = captures[REFERENCE]
    # The ``-p`` agents' captures only: a sub-agent's or the interactive CLI's prompt is another
    # prompt, which would cost a cold prefill of its own each time.
    others = [n for n in captures if n != REFERENCE and _kind(n) == "p"]
    for name in [REFERENCE, *others]:
        if name != REFERENCE:
            await _complete(http, translator.translate(reference).body)
        timings = await _complete(http, translator.translate(captures[name]).body)
        row = {
            "after": REFERENCE,
            "request": name,
            "cache_n": timings.get("cache_n"),
            "prompt_n": timings.get("prompt_n"),
            "prompt_ms": timings.get("prompt_ms"),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


async def _complete(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "stream": False, "max_tokens": 1}
    body.pop("stream_options", None)
    reply = await http.post(
        "/v1/chat/completions", json={**body, "id_slot": 0, "cache_prompt": True}
    )
    reply.raise_for_status()
    timings: dict[str, Any] = reply.json().get("timings", {})
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-only", action="store_true", help="skip the engine runs")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    out = anyio.run(_measure, not args.tokens_only)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
