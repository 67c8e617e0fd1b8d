"""Stand-in for `python -m sglang.launch_server` / `sglang_router.launch_router` (SGLang needs CUDA).

Serves GET /health with 200 on `--port`, after an optional `--fake-delay` seconds (so the sbatch script's
health wait is exercised), and records its argv and host in $MCORE_RL_RUN_DIR/fake_sglang-<port>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--fake-delay", type=float, default=0.0)
    args, rest = ap.parse_known_args()
    run_dir = Path(os.environ["MCORE_RL_RUN_DIR"])
    record = {"argv": rest, "port": args.port, "host": socket.gethostname(),
              "node": os.environ.get("SLURMD_NODENAME")}
    (run_dir / f"fake_sglang-{args.port}.json").write_text(json.dumps(record))
    time.sleep(args.fake_delay)
    ThreadingHTTPServer((args.host, args.port), Health).serve_forever()


if __name__ == "__main__":
    main()
