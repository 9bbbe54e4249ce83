"""Does restoring a saved slot give reuse on a model? ``python -m agentkv_bench.restore_reuse
MODEL.gguf [LLAMA-SERVER FLAGS…]``.

For each prompt length it computes the prompt on slot 0, saves it, erases slot 0, restores the
file into slot 1 and sends the same prompt plus 32 tokens there; for comparison it sends that
request to the slot that computed the prompt, without a save. Then it runs agentkv's startup
probe (:func:`agentkv.runtime.store.probe_restore`). Prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from agentkv.exceptions import EngineUnavailableError
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, find_llama_server
from agentkv.runtime.model import read_model_shape
from agentkv.runtime.store import probe_length, probe_restore

_TEXT = "".join(
    f"Rule {i}: check the input of step {i} twice, then write down why it changed.\n"
    for i in range(400)
)


async def _timings(client: LlamaSlotClient, tokens: list[int], slot: int) -> dict[str, Any]:
    """The timings of one raw completion (sent again once if the kept-alive connection that
    llama-server closes after a stream was picked)."""
    for attempt in range(2):
        try:
            found: dict[str, Any] = {}
            payload = {"prompt": tokens, "n_predict": 1, "temperature": 0.0}
            async with client.complete(payload, slot=slot) as chunks:
                async for chunk in chunks:
                    if isinstance(chunk.get("timings"), dict):
                        found = chunk["timings"]
            return found
        except EngineUnavailableError:
            if attempt:
                raise
    raise AssertionError("unreachable")


async def _slot(client: LlamaSlotClient, slot: int, action: str, filename: str = "") -> Any:
    calls = {
        "save": lambda: client.save_slot(slot, filename),
        "restore": lambda: client.restore_slot(slot, filename),
        "erase": lambda: client.erase_slot(slot),
    }
    try:
        return await calls[action]()
    except EngineUnavailableError:
        return await calls[action]()


async def measure(model: Path, extra: Sequence[str], lengths: Sequence[int]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="agentkv-restore-reuse-"))
    shape = read_model_shape(model, cache_dir=root)
    config = EngineConfig(
        model=model,
        slots=2,
        ctx_per_slot=4096,
        port=0,
        slot_save_dir=root / "slots",
        n_ctx_train=shape.n_ctx_train,
        cache_ram_mib=0,
        extra_args=tuple(extra),  # type: ignore[arg-type]  # attrs' plugin and a tuple converter
    )
    out: dict[str, Any] = {
        "model": model.name,
        "architecture": shape.architecture,
        "sliding_window": shape.sliding_window,
        "flags": list(extra),
    }
    process = LlamaServerProcess(config, binary=find_llama_server(), log_dir=root / "logs")
    async with process, process.client(read_timeout=900) as client:
        text_tokens = await client.tokenize(_TEXT)
        for n in lengths:
            tokens, extended = text_tokens[:n], text_tokens[: n + 32]
            await _slot(client, 0, "erase")
            await _timings(client, tokens, 0)
            same = await _timings(client, extended, 0)
            await _slot(client, 0, "erase")
            await _slot(client, 1, "erase")
            cold = await _timings(client, tokens, 0)
            started = time.monotonic()
            saved = await _slot(client, 0, "save", f"m{n}.bin")
            save_s = time.monotonic() - started
            await _slot(client, 0, "erase")
            started = time.monotonic()
            restored = await _slot(client, 1, "restore", f"m{n}.bin")
            restore_s = time.monotonic() - started
            after = await _timings(client, extended, 1)
            out[f"prompt {n}"] = {
                "cold_prompt_ms": round(float(cold.get("prompt_ms", 0))),
                "same_slot": [same.get("cache_n"), same.get("prompt_n")],
                "n_saved": saved.get("n_saved"),
                "bytes": saved.get("n_written"),
                "save_s": round(save_s, 3),
                "n_restored": restored.get("n_restored"),
                "restore_s": round(restore_s, 3),
                "after_restore": [after.get("cache_n"), after.get("prompt_n")],
            }
        n = probe_length(shape.sliding_window, batch=config.batch or 512)
        started = time.monotonic()
        probe = await probe_restore(client, root / "slots", compat="bench", n_tokens=n)
        out["probe"] = {
            "tokens": n,
            "result": probe.describe() if probe else None,
            "store_works": probe.reuses if probe else None,
            "seconds": round(time.monotonic() - started, 1),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentkv_bench.restore_reuse", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model", type=Path, help="the GGUF model")
    parser.add_argument("--lengths", default="256,1500", help="prompt lengths (default 256,1500)")
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    print(json.dumps(anyio.run(measure, args.model, extra, lengths), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
