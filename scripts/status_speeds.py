"""How much a status line's decode speed can be trusted, by reply length: the spread of
decode tok/s over repeated replies of 2 to 64 tokens on the embedded model, and which of them
the status line shows (chatcli.terminal.render.MIN_RATE_TOKENS and MIN_RATE_S).

    python scripts/status_speeds.py [--runs 8] [--json]

About 30 s on a 2-core CPU. The spread depends on the machine's load: run it on a quiet one
to see the model's own, on a busy one to see why a short measurement means little.
"""

from __future__ import annotations

import argparse
import json
import statistics

from chatcli.cli.session_setup import load_session, settings_from
from chatcli.terminal.render import MIN_RATE_S, MIN_RATE_TOKENS

LENGTHS = (2, 4, 8, 16, 32, 64)
PROMPT = "Tell me a long story about a dragon."


def measure(runs: int) -> list[dict]:
    session, _ = load_session(settings_from(temperature="0"), None)
    rows = []
    for length in LENGTHS:
        session.options.max_tokens = length
        rates, seconds = [], []
        for _ in range(runs):
            session.clear()
            list(session.send(PROMPT))
            stats = session.last_reply.stats
            if stats.tokens_out > 1 and stats.decode_tps:
                rates.append(stats.decode_tps)
                seconds.append((stats.tokens_out - 1) / stats.decode_tps)
        shown = sum(
            1
            for r, s in zip(rates, seconds, strict=True)
            if r * s >= MIN_RATE_TOKENS and s >= MIN_RATE_S
        )
        rows.append(
            {
                "max_tokens": length,
                "runs": len(rates),
                "tok_s_min": round(min(rates)),
                "tok_s_median": round(statistics.median(rates)),
                "tok_s_max": round(max(rates)),
                "decode_ms_median": round(1000 * statistics.median(seconds), 1),
                "shown": shown,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(args.runs)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"status line shows a decode speed from {MIN_RATE_TOKENS} tokens and {MIN_RATE_S} s")
    for r in rows:
        print(
            f"{r['max_tokens']:>3} tokens: {r['tok_s_min']:>5} .. {r['tok_s_median']:>5} .. "
            f"{r['tok_s_max']:>5} tok/s (min, median, max), decode {r['decode_ms_median']} ms, "
            f"shown {r['shown']}/{r['runs']}"
        )


if __name__ == "__main__":
    main()
