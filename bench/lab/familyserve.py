"""`spec-bench family`: serve one member pair of bench/lab/family.py in one process, or list the members.

`python -m bench family --member NAME --speedup K --port 0 --port-b 0` prints two `listening on URL` lines: the
speculative server, then the baseline. SIGTERM stops both. `--list` prints the members and their predicted curves.
"""
from __future__ import annotations

import asyncio
import sys

from bench.cli import ArgError, fail, parser, until_signal
from bench.lab.family import MEMBERS, Member, describe, start_pair


async def _serve(member: Member, speedup: float, port: int, port_b: int, seed: int) -> None:
    spec, base = await start_pair(member, speedup, port, port_b, seed)
    print(f"listening on {spec.url}", flush=True)
    print(f"listening on {base.url}", flush=True)
    await until_signal()
    await spec.close()
    await base.close()

def main(argv: list[str] | None = None) -> int:
    p = parser("family", __doc__.splitlines()[0])
    p.add_argument("--member", choices=sorted(MEMBERS), help="which pair to serve (see --list)")
    p.add_argument("--speedup", type=float, default=1.0, help="the servers' clock runs K times the wall clock")
    p.add_argument("--port", type=int, default=0, help="the speculative server's port (0: any free one)")
    p.add_argument("--port-b", type=int, default=0, help="the baseline server's port (0: any free one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the acceptance draws")
    p.add_argument("--list", action="store_true", help="print the members and their predicted curves")
    p.add_argument("--max-tokens", type=int, default=96, help="--list: the request length predicted for")
    try:
        ns = p.parse_args(argv)
    except ArgError as exc:
        return fail("family", exc)
    if ns.list:
        print("\n".join(describe(m, ns.max_tokens) for m in MEMBERS.values()))
        return 0
    if ns.member is None or ns.speedup <= 0:
        return fail("family", "give --member NAME (see --list) and a --speedup > 0")
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(_serve(MEMBERS[ns.member], ns.speedup, ns.port, ns.port_b, ns.seed))
    else:
        uvloop.run(_serve(MEMBERS[ns.member], ns.speedup, ns.port, ns.port_b, ns.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
