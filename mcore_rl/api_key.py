"""A shared API key for rollout servers, router and trainer that never appears on a command line.

Why: SGLang (`--api-key`) and sglang-router (`--api-key`) take the key as an argument, and every user on a
node can read every process's arguments (`ps`, /proc/<pid>/cmdline). The key lives in a mode-600 file
instead; `python -m mcore_rl.api_key --api-key-file F -- <program> [args]` starts a Python program in this
process with `--api-key=<key>` appended to *its* argv (sys.argv), so /proc shows only the file's path.
The trainer's client reads the same file (rollout.api_key_file) and sends `Authorization: Bearer <key>`;
`/health` stays open without it (SGLang, sglang-router and mcore-rl-serve alike), so health checks need none.
"""

from __future__ import annotations

import argparse
import hmac
import os
import runpy
import secrets
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

API_KEY_ENV = "MCORE_RL_API_KEY"  # how the launcher hands the key to the processes it starts (not argv)


class ApiKeyError(ValueError):
    """A missing, empty or too-widely readable key file, or an unset key variable (one line naming it)."""


def new_api_key() -> str:
    """32 random bytes, URL-safe, never starting with `-`: token_urlsafe's alphabet includes `-`, and a key
    that starts with it (1 draw in 64) is read by argparse as an option when passed as `--api-key <key>`."""
    while True:
        key = secrets.token_urlsafe(32)
        if not key.startswith("-"):
            return key


def write_api_key(path: str | Path) -> Path:
    """Create `path` with a fresh random key, mode 600 from the start (no window where others can read)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_api_key() + "\n")
    os.chmod(path, 0o600)
    return path


def read_api_key(path: str | Path) -> str:
    """The key in `path`; refuses a file that group or others may read (the key would not be secret)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        key = path.read_text().strip()
    except OSError as exc:
        raise ApiKeyError(f"api key file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ApiKeyError(f"api key file {path} has mode {stat.S_IMODE(mode):o}; it must be 600 (chmod 600 {path})")
    if not key or any(c.isspace() for c in key):
        raise ApiKeyError(f"api key file {path} is empty or holds more than one word")
    return key


def resolve_api_key(*, key: str | None = None, file: str | Path | None = None, env: str | None = None,
                    env_required: bool = True, where: str = "api key") -> str | None:
    """The one place a key is read: `key` as given, else `file` (read_api_key: mode 600 enforced), else the
    environment variable named `env` (unset: an error naming `where`, or None when not `env_required`); None
    when none is given. Never from a config value itself: configs get logged."""
    if key:
        return key
    if file:
        return read_api_key(file)
    value = os.environ.get(env, "").strip() if env else ""
    if env and not value and env_required:
        raise ApiKeyError(f"{where}={env}: that environment variable is not set")
    return value or None


def bearer_header(key: str | None) -> dict[str, str] | None:
    """What a client sends with every call when a key is set (SGLang's and the router's --api-key scheme)."""
    return {"Authorization": f"Bearer {key}"} if key else None


def has_bearer(headers: Mapping[str, str], key: str) -> bool:
    """The server side of `bearer_header`, compared in constant time (no timing oracle for the key)."""
    return hmac.compare_digest(headers.get("Authorization", "").encode(), f"Bearer {key}".encode())


def _console_script(name: str):
    from importlib.metadata import entry_points

    for ep in entry_points(group="console_scripts", name=os.path.basename(name)):
        return ep.load()
    return None


def run_with_key(key_file: str, flag: str, command: list[str]) -> None:
    """Run `command` in this process with `flag <key>` appended. Accepted forms: `python -m module [args]`,
    `-m module [args]`, or a console script installed with a Python package (e.g. `mcore-rl-serve [args]`)."""
    key = read_api_key(key_file)
    cmd = list(command)
    if cmd and os.path.basename(cmd[0]).startswith("python") and len(cmd) > 1 and cmd[1] == "-m":
        cmd = cmd[1:]
    if len(cmd) >= 2 and cmd[0] == "-m":
        sys.argv = [cmd[1], *cmd[2:], f"{flag}={key}"]  # one token: never parsed as a separate option
        runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
        return
    entry = _console_script(cmd[0]) if cmd else None
    if entry is None:
        raise SystemExit(f"mcore_rl.api_key: cannot run {cmd[:1]} in-process: give `python -m <module> ...` "
                         "or an installed console script")
    sys.argv = [cmd[0], *cmd[1:], f"{flag}={key}"]
    result = entry()
    raise SystemExit(result if isinstance(result, int) else 0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mcore_rl.api_key",
                                description="run a Python program with an API key read from a mode-600 file")
    p.add_argument("--api-key-file", required=True)
    p.add_argument("--flag", default="--api-key", help="the program's option for the key (default --api-key)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python -m module args | console-script args")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given after --")
    try:
        run_with_key(args.api_key_file, args.flag, command)
    except ApiKeyError as exc:
        raise SystemExit(f"mcore_rl.api_key: {exc}") from None


if __name__ == "__main__":
    main()
