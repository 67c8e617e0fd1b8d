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


def test_every_reader_goes_through_the_mode_check(tmp_path, monkeypatch):
    """The trainer's SGLang engine (rollout.api_key_file / _env) and mcore-rl-serve (--api-key-file, else the
    launcher's $MCORE_RL_API_KEY) read keys through one function: a world-readable file is refused by both."""
    import argparse

    from mcore_rl.api_key import API_KEY_ENV, resolve_api_key
    from mcore_rl.rollout.server.auth import server_api_key

    key_file = write_api_key(tmp_path / "key")
    key = read_api_key(key_file)
    args = argparse.Namespace(api_key=None, api_key_file=str(key_file))
    assert server_api_key(args) == key == resolve_api_key(file=key_file, env="UNUSED_VAR")
    key_file.chmod(0o640)
    with pytest.raises(ApiKeyError, match="has mode 640; it must be 600"):
        server_api_key(args)
    with pytest.raises(ApiKeyError, match="has mode 640"):
        resolve_api_key(file=key_file)
    monkeypatch.delenv("MCORE_RL_TEST_KEY", raising=False)
    with pytest.raises(ApiKeyError, match=r"^rollout.api_key_env=MCORE_RL_TEST_KEY: that environment var"):
        resolve_api_key(env="MCORE_RL_TEST_KEY", where="rollout.api_key_env")
    monkeypatch.setenv("MCORE_RL_TEST_KEY", " k1 \n")
    assert resolve_api_key(env="MCORE_RL_TEST_KEY") == "k1"
    no_flags = argparse.Namespace(api_key=None, api_key_file=None)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert server_api_key(no_flags) is None  # no key anywhere: the server runs open, as SGLang does
    monkeypatch.setenv(API_KEY_ENV, "from-launcher")
    assert server_api_key(no_flags) == "from-launcher"
    assert server_api_key(argparse.Namespace(api_key="flag", api_key_file=str(key_file))) == "flag"


def test_serve_refuses_a_readable_key_file_before_loading_the_model(tmp_path, capsys):
    from mcore_rl.rollout.server import main

    key_file = write_api_key(tmp_path / "key")
    key_file.chmod(0o644)
    with pytest.raises(SystemExit) as exc:
        main(["--model-path", str(tmp_path / "no_model_here"), "--api-key-file", str(key_file)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = f"mcore-rl-serve: error: api key file {key_file} has mode 644; it must be 600"
    assert err == [f"{want} (chmod 600 {key_file})"]


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


def test_keys_never_read_as_an_option():
    """2000 fresh keys (a leading `-` would come ~31 times in 2000 draws of token_urlsafe): each parses as given,
    both as `--api-key=<key>` (what the launcher and mcore_rl.api_key pass) and as `--api-key <key>`, through a
    plain argparse option and sglang-router's own parser."""
    import argparse

    from sglang_router.router_args import RouterArgs

    from mcore_rl.api_key import new_api_key

    plain = argparse.ArgumentParser()
    plain.add_argument("--api-key")
    router = argparse.ArgumentParser()
    RouterArgs.add_cli_args(router, use_router_prefix=False)
    keys = [new_api_key() for _ in range(2000)]
    assert len(set(keys)) == 2000 and not any(k.startswith("-") for k in keys)
    assert min(map(len, keys)) >= 43  # 32 random bytes
    for key in keys:
        assert plain.parse_args([f"--api-key={key}"]).api_key == key
        assert plain.parse_args(["--api-key", key]).api_key == key
    for key in keys[:200]:
        ns = router.parse_args(["--worker-urls", "http://a:1", f"--api-key={key}"])
        assert RouterArgs.from_cli_args(ns, use_router_prefix=False).api_key == key
    # the failure this guards against: a key with a leading `-` after a separate `--api-key`
    with pytest.raises(SystemExit):
        plain.parse_args(["--api-key", "-Zm9v"])
    assert plain.parse_args(["--api-key=-Zm9v"]).api_key == "-Zm9v"


def test_api_key_runner_passes_the_key_as_one_token(tmp_path):
    key_file = write_api_key(tmp_path / "key")
    key = read_api_key(key_file)
    script = "import sys, json; print(json.dumps(sys.argv[1:]))"
    (tmp_path / "show_argv.py").write_text(script)
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.api_key", "--api-key-file", str(key_file), "--",
                           "python", "-m", "show_argv", "--x", "1"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": f"{REPO}:{tmp_path}"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["--x", "1", f"--api-key={key}"]
