"""The `sft.*` keys: each one set through the CLI by some test, bad values and unknown keys refused in one line;
LoRA through the same `model.lora.*` keys as RL."""

from __future__ import annotations

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.sft.config import load_sft_config, register_sft_schema
from tests.config.keyscan import REPO, cli_overrides_in_tests, compose, leaf_keys
from tests.sft.conftest import addition_rows, write_jsonl
from tests.sft.helpers import losses, ok, sft


def _compose(*overrides: str):
    register_sft_schema()
    return compose(["model=tiny", "sft.data.path=rows.jsonl", *overrides], "sft")


def test_every_sft_key_is_set_through_the_cli_in_a_test():
    keys = {k for k in leaf_keys(_compose()) if k.startswith("sft.")}
    assert len(keys) == 15, sorted(keys)
    tested = cli_overrides_in_tests(REPO / "tests" / "sft")
    assert not sorted(keys - tested), f"sft keys no test sets through the CLI: {sorted(keys - tested)}"


def test_every_sft_field_is_read_by_the_run_code():
    """Each `sft.*` field is read outside its own validation (a key no code reads would be silently ignored)."""
    import dataclasses
    import re

    from mcore_rl.sft.config import SftConfig, SftDataConfig

    code = "\n".join(p.read_text() for p in (REPO / "mcore_rl" / "sft").glob("*.py") if p.name != "config.py")
    fields = [
        f.name for cls in (SftConfig, SftDataConfig) for f in dataclasses.fields(cls) if f.name != "data"
    ]
    unread = [name for name in fields if not re.search(rf"\.{name}\b", code)]
    assert not unread, unread


@pytest.mark.parametrize("override, message", [
    ("sft.resume=sometimes", "sft.resume"),
    ("sft.batch_size=0", "sft.batch_size"),
    ("sft.data.heldout_fraction=1.5", "sft.data.heldout_fraction"),
    ("sft.pack_rows=maybe", "sft.pack_rows"),
    ("sft.steps=-1", "sft.steps"),
])  # fmt: skip
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_sft_config(_compose(override))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_unknown_keys_and_missing_data_in_one_line(tmp_path):
    proc = sft(["model=tiny", "sft.stpes=3", f"run.dir={tmp_path / 'a'}"])
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
    assert proc.stderr.startswith("config error:") and "stpes" in proc.stderr
    proc = sft(["model=tiny", f"sft.data.path={tmp_path / 'missing.jsonl'}", f"run.dir={tmp_path / 'b'}"])
    assert proc.returncode == 2 and "sft.data.path" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]


def test_lora_sft_trains_adapters_and_exports_them(tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", addition_rows(8))
    run_dir = tmp_path / "run"
    ok(
        sft(
            [
                "model=tiny",
                f"sft.data.path={rows}",
                "sft.data.heldout_fraction=0.25",
                "sft.steps=3",
                "sft.batch_size=3",
                "model.lora.rank=4",
                "model.lora.alpha=8",
                "optim.lr=5e-3",
                "logging.progress=false",
                "logging.plot=false",
                f"run.dir={run_dir}",
            ]
        )
    )
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3] and got[3] < got[1]
    assert (run_dir / "lora" / "adapters.safetensors").is_file() and (
        run_dir / "hf" / "config.json"
    ).is_file()
