"""Generation at depth: what the engine's settings and speculative decoding do to a reply.

Three replies (``copy``, ``json``, ``prose``) on a module the agent has just read, at
depth ``1k`` or ``12k`` (on Claude Code's captured first request). :func:`settings_table`
(``python -m agentkv_bench.decode settings|spec``) times one raw-engine launch per setting, each
restoring a saved head; :func:`run_decode` (``--scenario decode``) runs llama-server alone and
agentkv side by side (docs/benchmarks.md). Every request is greedy, so two configurations that
compute the same thing write the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, find_llama_server
from agentkv.runtime.model import default_model_path, read_model_shape
from agentkv.tokens import common_prefix
from agentkv.translate import MessagesTranslator
from agentkv_bench.claude_workload import _captured, claude_template
from agentkv_bench.drivers import Clients, open_stream, sdk_clients

__all__ = [
    "DEPTHS",
    "KINDS",
    "DecodeSpec",
    "bodies",
    "decode_table",
    "run_decode",
    "settings_table",
]

KINDS = ("copy", "json", "prose")
DEPTHS = ("1k", "12k")
#: Tokens before the shared head's end that a settings launch computes at depth (the restored
#: state stops this far short of the head), so that each launch measures prefill at depth too.
TAIL = 512
_SECONDS = 1800.0
_TIMEOUT = httpx.Timeout(_SECONDS, connect=10.0)


def bodies(depth: str, *, max_tokens: int) -> dict[str, dict[str, Any]]:
    """The Messages request of each kind of reply at ``depth`` (greedy, not streamed)."""
    work = _captured("decode_workload.json")
    base = claude_template()
    read = next(tool for tool in base["tools"] if tool["name"] == "Read")
    if depth != "12k":
        base = {"model": "agentkv-local", "system": "You are a careful coding assistant."}
        # A short Read tool: its real description alone is about 1,300 tokens.
        base["tools"] = [{**read, "description": "Reads a file from the local filesystem."}]
        base["messages"] = [{"role": "user", "content": f"Read {work['file_name']}."}]
    numbered = "".join(
        f"{n:>6}\t{line}\n" for n, line in enumerate(work["file"].splitlines(), start=1)
    )
    call = {
        "type": "tool_use",
        "id": "toolu_decode_read",
        "name": read["name"],
        "input": {"file_path": f"/home/demo/project/{work['file_name']}"},
    }
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        body = copy.deepcopy(base)
        body["messages"] = [
            *body["messages"],
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call["id"], "content": numbered},
                    {"type": "text", "text": work["asks"][kind]},
                ],
            },
        ]
        body.update(max_tokens=max_tokens, temperature=0.0, stream=False)
        body.pop("thinking", None)
        out[kind] = body
    return out


def chat_bodies(depth: str, *, max_tokens: int) -> dict[str, dict[str, Any]]:
    """The llama-server chat body agentkv makes of each request (what llama-server alone gets,
    so that both configurations compute the same prompt)."""
    translator = MessagesTranslator()
    return {
        kind: translator.translate(body).body
        for kind, body in bodies(depth, max_tokens=max_tokens).items()
    }


# -- the raw engine -------------------------------------------------------------------------------


@attrs.frozen
class Setting:
    """One launch of the settings table: a name and llama-server's flags for it."""

    name: str
    flags: tuple[str, ...]
    #: The saved head it can restore: KV type and flash attention change the state's layout.
    layout: str


async def _complete(
    http: httpx.AsyncClient, tokens: Sequence[int], *, slot: int, n_predict: int
) -> dict[str, Any]:
    """A greedy raw completion of ``tokens`` on ``slot``: the reply's text and timings."""
    payload = {
        "prompt": list(tokens),
        "n_predict": n_predict,
        "temperature": 0.0,
        "id_slot": slot,
        "cache_prompt": True,
        "stream": False,
    }
    try:
        response = await http.post("/completion", json=payload)
    except httpx.TransportError:  # a kept-alive connection that llama-server closed: once more
        response = await http.post("/completion", json=payload)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


async def _slot_action(http: httpx.AsyncClient, slot: int, action: str, filename: str) -> Any:
    body = {"filename": filename} if filename else {}
    response = await http.post(f"/slots/{slot}", params={"action": action}, json=body)
    response.raise_for_status()
    return response.json()


@contextlib.asynccontextmanager
async def _engine(
    model: Path, flags: Sequence[str], root: Path, *, slots: int, ctx: int, name: str
) -> AsyncIterator[httpx.AsyncClient]:
    shape = read_model_shape(model, cache_dir=root)
    config = EngineConfig(
        model=model,
        slots=slots,
        ctx_per_slot=ctx,
        port=0,
        slot_save_dir=root / "slots",
        n_ctx_train=shape.n_ctx_train,
        cache_ram_mib=0,
        batch=None,
        extra_args=tuple(flags),  # type: ignore[arg-type]  # attrs' plugin and a tuple converter
    )
    (root / "slots").mkdir(parents=True, exist_ok=True)
    process = LlamaServerProcess(
        config, binary=find_llama_server(), log_dir=root / "logs" / name, api_key=None
    )
    async with process, httpx.AsyncClient(base_url=process.base_url, timeout=_TIMEOUT) as http:
        yield http


def _summary(data: Mapping[str, Any]) -> dict[str, Any]:
    t = data.get("timings", {})
    return {
        "prompt_n": t.get("prompt_n"),
        "prefill_tps": round(float(t.get("prompt_per_second", 0.0)), 2),
        "predicted_n": t.get("predicted_n"),
        "decode_tps": round(float(t.get("predicted_per_second", 0.0)), 2),
        "draft_n": int(t.get("draft_n", 0) or 0),
        "draft_accepted": int(t.get("draft_n_accepted", 0) or 0),
        "text": data.get("content", ""),
    }


async def settings_table(
    settings: Sequence[Setting],
    *,
    depth: str = "12k",
    kinds: Sequence[str] = KINDS,
    max_tokens: int = 96,
    model: Path | None = None,
    root: Path | None = None,
    echo: Any = print,
) -> dict[str, Any]:
    """Each setting's prefill and decode speed at ``depth``, one launch each (see the module)."""
    model = model or default_model_path()
    root = root or Path(tempfile.mkdtemp(prefix="agentkv-decode-settings-"))
    chat = chat_bodies(depth, max_tokens=max_tokens)
    prompts: dict[str, list[int]] = {}
    heads: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    ctx = 16384
    for setting in settings:
        async with _engine(model, setting.flags, root, slots=1, ctx=ctx, name=setting.name) as http:
            if not prompts:
                async with LlamaSlotClient(str(http.base_url)) as client:
                    for kind in kinds:
                        prompts[kind] = await client.prompt_tokens(chat[kind])
                shared = min(common_prefix(prompts[kinds[0]], prompts[k]) for k in kinds)
                heads["_shared"] = {"tokens": shared}
                echo(f"prompts: {[len(p) for p in prompts.values()]} tokens, {shared} shared")
            shared = int(heads["_shared"]["tokens"])
            first = prompts[kinds[0]]
            file = f"head-{setting.layout}.bin"
            if setting.layout not in heads and (root / "slots" / file).exists():
                heads[setting.layout] = {"tokens": shared - TAIL, "reused": True}
            if setting.layout not in heads:
                started = time.monotonic()
                cold = await _complete(http, first[: shared - TAIL], slot=0, n_predict=1)
                await _slot_action(http, 0, "save", file)
                heads[setting.layout] = {
                    "tokens": shared - TAIL,
                    "cold_prefill_tps": _summary(cold)["prefill_tps"],
                    "seconds": round(time.monotonic() - started, 1),
                }
                echo(f"{setting.layout}: head computed, {heads[setting.layout]}")
            row: dict[str, Any] = {"setting": setting.name, "flags": " ".join(setting.flags)}
            for kind in kinds:
                await _slot_action(http, 0, "restore", file)
                got = _summary(await _complete(http, prompts[kind], slot=0, n_predict=max_tokens))
                row[kind] = got
                echo(
                    f"{setting.name:<24} {kind:<6} prefill {got['prefill_tps']:>7} t/s "
                    f"({got['prompt_n']}), decode {got['decode_tps']:>6} t/s, "
                    f"drafts {got['draft_accepted']}/{got['draft_n']}"
                )
            rows.append(row)
    return {
        "depth": depth,
        "prompt_tokens": {k: len(v) for k, v in prompts.items()},
        "heads": heads,
        "rows": rows,
    }


#: The settings table of docs/engine.md: the defaults first, then one change at a time.
SETTINGS: tuple[Setting, ...] = tuple(
    Setting(name, tuple(flags.split()), layout)
    for name, flags, layout in (
        ("f16, fa off, b512", "-fa off -b 512 -ub 512", "f16-nofa"),
        ("f16, fa on, b512", "-fa on -b 512 -ub 512", "f16-fa"),
        ("q8_0, fa on, b512", "-fa on -ctk q8_0 -ctv q8_0 -b 512 -ub 512", "q8-fa"),
        ("f16, fa off, b2048/ub512", "-fa off -b 2048 -ub 512", "f16-nofa"),
        ("f16, fa off, b2048/ub2048", "-fa off -b 2048 -ub 2048", "f16-nofa"),
        ("f16, fa off, b512/ub256", "-fa off -b 512 -ub 256", "f16-nofa"),
        ("f16, fa off, b512, t1", "-fa off -b 512 -ub 512 -t 1", "f16-nofa"),
    )
)
SPEC_TYPES = ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v")


def spec_settings(base: Setting) -> tuple[Setting, ...]:
    """``base`` with each draftless speculative type."""
    return tuple(
        Setting(f"{base.name}, {kind}", (*base.flags, "--spec-type", kind), base.layout)
        for kind in SPEC_TYPES
    )


# -- the scenario: llama-server alone against agentkv ---------------------------------------------


@attrs.frozen
class DecodeSpec:
    """What ``--scenario decode`` runs: at each depth, each kind of reply once with one agent,
    then ``copy`` with two agents decoding at once."""

    depths: tuple[str, ...] = DEPTHS
    kinds: tuple[str, ...] = KINDS
    max_tokens: int = 128
    two_agents: bool = True
    slot_context: int = 16384

    @classmethod
    def quick(cls) -> DecodeSpec:
        return cls(depths=("1k",), max_tokens=48)


@attrs.frozen
class Reply:
    """One measured reply, as its client saw it and as the engine reported it."""

    text: str
    output_tokens: int
    first_token_s: float
    total_s: float
    #: The engine's own decode time for the reply (llama-server's ``predicted_ms``).
    engine_decode_s: float
    draft_tokens: int
    draft_accepted: int

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first, on the engine's clock."""
        return self.output_tokens / self.engine_decode_s if self.engine_decode_s > 0 else 0.0

    def row(self) -> dict[str, Any]:
        return {
            "output_tokens": self.output_tokens,
            "decode_tps": round(self.decode_tps, 2),
            "first_token_s": round(self.first_token_s, 2),
            "total_s": round(self.total_s, 2),
            "draft_tokens": self.draft_tokens,
            "draft_accepted": self.draft_accepted,
        }


def _text_of(message: Mapping[str, Any]) -> str:
    """A reply's words and tool calls as one string, the same for both APIs' shapes."""
    parts = []
    for block in message.get("content") or []:
        if block.get("type") == "text":
            parts.append(block["text"])
        elif block.get("type") == "tool_use":
            parts.append(json.dumps({block["name"]: block["input"]}, sort_keys=True))
    return "".join(parts)


async def _alone_reply(clients: Clients, body: Mapping[str, Any], slot: int) -> Reply:
    """One streamed chat completion from llama-server alone, pinned to ``slot``, through the
    ``openai`` SDK (llama-server's own fields, and its ``timings``, pass through it)."""
    payload = {**body, "id_slot": slot, "cache_prompt": True}
    payload["stream_options"] = {"include_usage": True}
    started = time.monotonic()
    first: float | None = None
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    timings: dict[str, Any] = {}
    async with await open_stream(clients, "chat", payload, {}) as stream:
        async for event in stream:
            chunk = event.to_dict()
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or ""
                if (piece or delta.get("tool_calls")) and first is None:
                    first = time.monotonic() - started
                text.append(piece)
                for call in delta.get("tool_calls") or []:
                    if call.get("function", {}).get("name"):
                        calls.append({"name": call["function"]["name"], "arguments": ""})
                    if calls and call.get("function", {}).get("arguments"):
                        calls[-1]["arguments"] += call["function"]["arguments"]
    words = "".join(text) + "".join(
        json.dumps({c["name"]: json.loads(c["arguments"] or "{}")}, sort_keys=True) for c in calls
    )
    total = time.monotonic() - started
    return Reply(
        text=words,
        output_tokens=int(timings.get("predicted_n", 0)),
        first_token_s=first if first is not None else total,
        total_s=total,
        engine_decode_s=float(timings.get("predicted_ms", 0.0)) / 1000,
        draft_tokens=int(timings.get("draft_n", 0) or 0),
        draft_accepted=int(timings.get("draft_n_accepted", 0) or 0),
    )


async def _agentkv_reply(url: str, runtime: Any, body: Mapping[str, Any], agent: str) -> Reply:
    """One streamed Messages request through agentkv-server's app, with the ``anthropic`` SDK."""
    import anthropic

    started = time.monotonic()
    first: float | None = None
    async with anthropic.AsyncAnthropic(
        base_url=url, api_key="agentkv", timeout=_SECONDS, max_retries=0
    ) as sdk:
        # Claude Code's fields (context_management, output_config, temperature...) are not all
        # arguments of this SDK's stream(): everything but the essentials goes in the body as is.
        essentials = ("model", "messages", "max_tokens")
        rest = {k: v for k, v in body.items() if k not in (*essentials, "stream")}
        async with sdk.messages.stream(
            **{k: body[k] for k in essentials},
            extra_headers={"x-agent-id": agent},
            extra_body=rest,
        ) as stream:
            async for event in stream:
                if first is None and event.type in ("text", "input_json"):
                    first = time.monotonic() - started
            message = (await stream.get_final_message()).model_dump()
    total = time.monotonic() - started
    record = next(r for r in reversed(runtime.records()) if r.agent == agent)
    return Reply(
        text=_text_of(message),
        output_tokens=int(message["usage"]["output_tokens"]),
        first_token_s=first if first is not None else total,
        total_s=total,
        engine_decode_s=record.decode_s,
        draft_tokens=record.draft_tokens,
        draft_accepted=record.draft_accepted,
    )


async def _at_once(*calls: Callable[[], Awaitable[Reply]]) -> list[Reply]:
    """The calls' replies, the calls made at the same time."""
    replies: dict[int, Reply] = {}

    async def one(index: int, call: Callable[[], Awaitable[Reply]]) -> None:
        replies[index] = await call()

    async with anyio.create_task_group() as tg:
        for index, call in enumerate(calls):
            tg.start_soon(one, index, call)
    return [replies[i] for i in sorted(replies)]


def _pair(replies: Sequence[Reply]) -> dict[str, Any]:
    """Two agents decoding at once: their tokens over the span in which both decoded."""
    span = max(r.engine_decode_s for r in replies)
    tokens = sum(r.output_tokens for r in replies)
    return {
        "aggregate_tps": round(tokens / span, 2) if span > 0 else 0.0,
        "replies": [r.row() for r in replies],
    }


async def _run_alone(
    spec: DecodeSpec, root: Path, model: Path, echo: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    """llama-server alone: its own flags (no speculative decoding), the same prompts."""
    flags = ("--jinja", "-fa", "auto")
    out: dict[str, Any] = {"flags": " ".join(flags)}
    texts: dict[str, str] = {}
    async with (
        _engine(model, flags, root / "alone", slots=2, ctx=spec.slot_context, name="alone") as http,
        sdk_clients(str(http.base_url).rstrip("/"), request_timeout=_SECONDS) as clients,
    ):
        for depth in spec.depths:
            chat = chat_bodies(depth, max_tokens=spec.max_tokens)
            warm = {**chat["copy"], "max_tokens": 1}
            await _alone_reply(clients, warm, 0)  # the agent's earlier turns: the context is cached
            for kind in spec.kinds:
                reply = await _alone_reply(clients, chat[kind], 0)
                out[f"{depth} {kind}"] = reply.row()
                texts[f"{depth} {kind}"] = reply.text
                echo(f"alone   {depth:>3} {kind:<5} {reply.row()}")
            if spec.two_agents:
                # The second agent's slot holds the same context (restored, not timed).
                await _slot_action(http, 0, "save", f"two-{depth}.bin")
                await _slot_action(http, 1, "restore", f"two-{depth}.bin")
                await _alone_reply(clients, warm, 1)
                replies = await _at_once(
                    *(
                        functools.partial(_alone_reply, clients, chat["copy"], slot)
                        for slot in (0, 1)
                    )
                )
                out[f"{depth} copy x2"] = _pair(replies)
                echo(f"alone   {depth:>3} copy x2 {out[f'{depth} copy x2']}")
    return out, texts


async def _run_agentkv(
    spec: DecodeSpec, root: Path, model: Path, echo: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    """agentkv as ``agentkv-server`` builds it (:func:`agentkv_engine`), pre-emption included."""
    from agentkv.runtime.config import RuntimeConfig
    from agentkv_bench.engines import EngineSetup, agentkv_engine

    setup = EngineSetup(find_llama_server(), model, 2, spec.slot_context, root / "logs")
    out: dict[str, Any] = {
        "settings": f"the defaults, --slots 2 --ctx-per-slot {spec.slot_context}"
    }
    texts: dict[str, str] = {}
    async with agentkv_engine(setup, store_dir=root / "store", config=RuntimeConfig()) as engine:
        runtime, url = engine.runtime, engine.url
        for depth in spec.depths:
            requests = bodies(depth, max_tokens=spec.max_tokens)
            warm = {**requests["copy"], "max_tokens": 1}
            await _agentkv_reply(url, runtime, warm, f"a-{depth}")
            for kind in spec.kinds:
                reply = await _agentkv_reply(url, runtime, requests[kind], f"a-{depth}")
                out[f"{depth} {kind}"] = reply.row()
                texts[f"{depth} {kind}"] = reply.text
                echo(f"agentkv {depth:>3} {kind:<5} {reply.row()}")
            if spec.two_agents:
                # The second agent's context on a slot of its own, as the copied slot of the
                # configuration alone: set up while the first agent's slot is busy (on an
                # idle slot that holds the same context agentkv would place it there).
                busy = {**requests["copy"], "max_tokens": 16}
                await _at_once(
                    functools.partial(_agentkv_reply, url, runtime, busy, f"a-{depth}"),
                    functools.partial(_agentkv_reply, url, runtime, warm, f"b-{depth}"),
                )
                replies = await _at_once(
                    *(
                        functools.partial(_agentkv_reply, url, runtime, requests["copy"], a)
                        for a in (f"a-{depth}", f"b-{depth}")
                    )
                )
                out[f"{depth} copy x2"] = _pair(replies)
                echo(f"agentkv {depth:>3} copy x2 {out[f'{depth} copy x2']}")
    return out, texts


async def run_decode(
    spec: DecodeSpec, out_dir: Path, *, model: Path | None = None, echo: Any = print
) -> dict[str, Any]:
    """Both configurations one after the other, in one run; the ratios agentkv / alone."""
    model = model or default_model_path()
    await anyio.Path(out_dir).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    alone, alone_texts = await _run_alone(spec, out_dir, model, echo)
    agentkv, agentkv_texts = await _run_agentkv(spec, out_dir, model, echo)
    ratios: dict[str, Any] = {}
    for key, row in alone.items():
        if key == "flags":
            continue
        theirs = agentkv[key]
        if "aggregate_tps" in row:
            base = row["aggregate_tps"]
            ratios[key] = round(theirs["aggregate_tps"] / base, 2) if base else None
        else:
            base = row["decode_tps"]
            ratios[key] = {
                "decode": round(theirs["decode_tps"] / base, 2) if base else None,
                "first_token": round(theirs["first_token_s"] / row["first_token_s"], 2),
                "identical": alone_texts[key] == agentkv_texts[key],
            }
    report = {
        "scenario": "decode",
        "spec": attrs.asdict(spec),
        "llama-server": alone,
        "agentkv": agentkv,
        "ratios": ratios,
        "texts": {"llama-server": alone_texts, "agentkv": agentkv_texts},
        "total_s": round(time.monotonic() - started, 1),
    }
    await anyio.Path(out_dir / "decode.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def decode_table(report: Mapping[str, Any]) -> str:
    """The report as the text table docs/benchmarks.md shows."""
    lines = [
        "| reply | llama-server alone, tokens/s | agentkv, tokens/s | ratio | drafts accepted "
        "| first token (alone → agentkv) | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    alone, agentkv = report["llama-server"], report["agentkv"]
    for key, ratio in report["ratios"].items():
        a, b = alone[key], agentkv[key]
        if isinstance(ratio, dict):
            lines.append(
                f"| {key} | {a['decode_tps']} | {b['decode_tps']} | {ratio['decode']}× "
                f"| {b['draft_accepted']}/{b['draft_tokens']} "
                f"| {a['first_token_s']} → {b['first_token_s']} s | {ratio['identical']} |"
            )
        else:
            drafted = sum(r["draft_tokens"] for r in b["replies"])
            accepted = sum(r["draft_accepted"] for r in b["replies"])
            lines.append(
                f"| {key} (aggregate) | {a['aggregate_tps']} | {b['aggregate_tps']} | {ratio}× "
                f"| {accepted}/{drafted} | | |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentkv_bench.decode")
    parser.add_argument("what", choices=("settings", "spec"))
    parser.add_argument("--depth", choices=DEPTHS, default="12k")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--only", action="append", default=[], help="settings by name")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--kind", action="append", choices=KINDS, help="default: all three")
    parser.add_argument("--root", type=Path, help="keep the saved heads here, for a later run")
    args = parser.parse_args(argv)
    chosen = SETTINGS if args.what == "settings" else (SETTINGS[0], *spec_settings(SETTINGS[0]))
    if args.only:
        chosen = tuple(s for s in chosen if s.name in args.only)
    result = anyio.run(
        lambda: settings_table(
            chosen,
            depth=args.depth,
            max_tokens=args.max_tokens,
            kinds=tuple(args.kind or KINDS),
            root=args.root,
        )
    )
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
