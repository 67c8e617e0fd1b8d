"""A stand-in SGLang worker for the NCCL weight-sync path, run as a subprocess with gloo on CPU.

It implements only what the trainer side drives: /init_weights_update_group (joins the side group as
`rank_offset`) and /update_weights_from_distributed (receives each announced tensor by broadcast from rank 0),
plus /get_weights_by_name and /server_info so the test can read back what arrived.
"""

from __future__ import annotations

import argparse
import asyncio
import math

import torch
import torch.distributed as dist
from aiohttp import web

from mcore_rl.rollout.sglang.api import unknown_fields
from mcore_rl.rollout.weight_sync.dist_group import init_weight_update_group

STATE: dict = {"group": None, "weights": {}, "calls": []}


async def _json(request: web.Request, endpoint: str) -> dict:
    body = await request.json()
    bad = unknown_fields(endpoint, body)
    if bad:
        raise web.HTTPBadRequest(text=f"unknown fields {bad}")
    return body


async def init_group(request: web.Request) -> web.Response:
    b = await _json(request, "/init_weights_update_group")
    STATE["group"] = await asyncio.get_running_loop().run_in_executor(
        None, init_weight_update_group, b["master_address"], b["master_port"], b["rank_offset"], b["world_size"],
        b["group_name"], b["backend"],
    )  # fmt: skip
    return web.json_response({"success": True, "message": "joined"})


def _receive(b: dict) -> None:
    if b.get("load_format") == "flattened_bucket":  # SGLang 0.5.23: one buffer, entries back to back
        sizes = [math.prod(s) * getattr(torch, d).itemsize for d, s in zip(b["dtypes"], b["shapes"])]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=STATE["group"])
        offset = 0
        for name, dtype, shape, n in zip(b["names"], b["dtypes"], b["shapes"], sizes):
            STATE["weights"][name] = flat[offset : offset + n].view(getattr(torch, dtype)).reshape(shape)
            offset += n
        return
    for name, dtype, shape in zip(b["names"], b["dtypes"], b["shapes"]):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=0, group=STATE["group"])
        STATE["weights"][name] = t


async def update_distributed(request: web.Request) -> web.Response:
    b = await _json(request, "/update_weights_from_distributed")
    await asyncio.get_running_loop().run_in_executor(None, _receive, b)
    STATE["calls"].append(
        {k: b.get(k) for k in ("names", "weight_version", "flush_cache", "group_name", "load_format")}
    )
    return web.json_response({"success": True, "message": "ok"})


async def get_weights(request: web.Request) -> web.Response:
    b = await _json(request, "/get_weights_by_name")
    return web.json_response(
        STATE["weights"][b["name"]].float().flatten()[: b.get("truncate_size", 100)].tolist()
    )


async def server_info(request: web.Request) -> web.Response:
    return web.json_response({"calls": STATE["calls"]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    app = web.Application()
    app.add_routes(
        [
            web.post("/init_weights_update_group", init_group),
            web.post("/update_weights_from_distributed", update_distributed),
            web.post("/get_weights_by_name", get_weights),
            web.get("/server_info", server_info),
            web.get("/health", health),
        ]
    )
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
