"""The per-job API key: a mode-600 file, never on a command line; mcore-rl-serve enforces it like SGLang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from mcore_rl.api_key import ApiKeyError, read_api_key, write_api_key
from mcore_rl.distributed import free_port
from tests.conftest import REPO


def test_key_file_must_be_private_and_non_empty(tmp_path):
    key_file = write_api_key(tmp_path / "key")
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert len(read_api_key(key_file)) >= 32
    key_file.chmod(0o644)
    with pytest.raises(ApiKeyError, match=r"has mode 644; it must be 600"):
        read_api_key(key_file)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(ApiKeyError, match="is empty"):
        read_api_key(empty)
    with pytest.raises(ApiKeyError, match="No such file"):
        read_api_key(tmp_path / "missing")


def _get(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_serve_requires_the_key_that_no_command_line_shows(tmp_path, tiny_llama_dir):
    key_file = write_api_key(tmp_path / "key")
    key = read_api_key(key_file)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mcore_rl.api_key", "--api-key-file", str(key_file), "--",
                             "mcore-rl-serve", "--model-path", str(tiny_llama_dir), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "server not up"
            try:
                if _get(base + "/health") == 200:  # open without a key, as in SGLang (probes, the router)
                    break
            except OSError:
                time.sleep(0.3)
        assert key not in open(f"/proc/{proc.pid}/cmdline", "rb").read().decode(errors="replace")
        assert _get(base + "/model_info") == 401
        assert _get(base + "/model_info", "wrong") == 401
        assert _get(base + "/model_info", key) == 200
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).encode()
        req = urllib.request.Request(base + "/generate", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert len(json.load(resp)["output_ids"]) == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert key not in proc.stdout.read()  # nor in the server's log


def test_launcher_refuses_a_readable_key_file(tmp_path):
    key_file = write_api_key(tmp_path / "key")
    key_file.chmod(0o640)
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.api_key", "--api-key-file", str(key_file), "--",
                           "python", "-m", "json.tool"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and "has mode 640; it must be 600" in proc.stderr and "Traceback" not in proc.stderr
