"""Test-only: `hstap.serve.hf_server.create_app` behind a middleware that misbehaves on purpose.

    python tests/synth/faulty_server.py --port P [--p500 0.3] [--pslow 0.2] [--slow-s 6] [--seed 0] \\
        [--name NAME] [--log FILE] [--max-batch 8]

For each chat completion a seeded RNG picks: answer 500 (`--p500`), stall `--slow-s` seconds and then answer 503
without generating (`--pslow`; set it past the client's timeout), or pass the request to the real app. With
`--log FILE` every decision is appended as one JSON line `{"fault": "500"|"slow"|"ok", "messages": [...]}`,
so a test can check which requests the server saw, and in which order. Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import torch
import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse

from hstap.models import load_target
from hstap.serve.hf_server import create_app


def build(target, name: str, p500: float, pslow: float, slow_s: float, seed: int, log: str | None, max_batch: int):
    app = create_app(target, name, max_batch=max_batch)
    rng = random.Random(seed)

    @app.middleware("http")
    async def faults(request: Request, call_next):
        if request.url.path != "/v1/chat/completions":
            return await call_next(request)
        body = await request.body()
        r = rng.random()
        fault = "500" if r < p500 else "slow" if r < p500 + pslow else "ok"
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"fault": fault, "messages": json.loads(body).get("messages")}) + "\n")
        if fault == "500":
            return JSONResponse(status_code=500, content={"error": {"message": "injected fault"}})
        if fault == "slow":
            await asyncio.sleep(slow_s)
            return JSONResponse(status_code=503, content={"error": {"message": "injected stall"}})
        return await call_next(request)

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default=None)
    ap.add_argument("--p500", type=float, default=0.0)
    ap.add_argument("--pslow", type=float, default=0.0)
    ap.add_argument("--slow-s", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default=None)
    ap.add_argument("--max-batch", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the test machine is shared: oversubscribed intra-op threads crawl
    target = load_target("smollm2")
    app = build(target, args.name or target.model_id, args.p500, args.pslow, args.slow_s, args.seed, args.log,
                args.max_batch)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
