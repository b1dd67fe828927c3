"""What a long `previous_response_id` chain costs the response store (CPU, no GPU): the file's
size and the time to rebuild the conversation a follow-up continues, with conversations stored
as deltas on their parents' (server/store.py) against whole copies (each turn storing every
item before it, as the store did before).

    python bench/store_chain.py [--turns 1000] [--item-kb 2] [--out bench/results/store_chain.json]

Each turn adds two items (an input and an output) of ``--item-kb`` KB of text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from gptoss_serve.server.store import ResponseStore


def _run(turns: int, item_kb: int, whole: bool, folder: Path) -> dict:
    path = folder / ("whole.sqlite3" if whole else "deltas.sqlite3")
    store = ResponseStore(path)
    text = "x" * (item_kb * 1024)
    parent = None
    so_far: list[dict] = []  # the whole conversation, as the server passes it
    started = time.perf_counter()
    for turn in range(turns):
        own = [{"kind": "message", "text": text}, {"kind": "message", "text": text}]
        so_far += own
        response = {"id": f"resp_{turn}", "created_at": int(time.time()), "output": []}
        store.put(response, [], so_far, None if whole else parent)
        parent = (response["id"], 0, len(so_far))
    write_s = time.perf_counter() - started
    rebuild_ms = {}
    for length in sorted({10, 100, turns}):
        if length <= turns:
            started = time.perf_counter()
            items = store.conversation(f"resp_{length - 1}") or []
            rebuild_ms[length] = round((time.perf_counter() - started) * 1e3, 2)
            assert len(items) == 2 * length
    store.close()
    return {"file_mb": round(path.stat().st_size / 1e6, 2), "write_s": round(write_s, 2),
            "rebuild_ms_by_turns": rebuild_ms}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--item-kb", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = {
            "turns": args.turns, "item_kb": args.item_kb,
            "deltas": _run(args.turns, args.item_kb, whole=False, folder=Path(folder)),
            "whole_copies": _run(args.turns, args.item_kb, whole=True, folder=Path(folder)),
        }  # fmt: skip
    for kind in ("deltas", "whole_copies"):
        row = results[kind]
        sys.stdout.write(f"{kind:13s} file {row['file_mb']:9.2f} MB  writes {row['write_s']:7.2f} "
                         f"s  rebuild ms by turns {row['rebuild_ms_by_turns']}\n")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
