"""Atomic, bucketed safetensors folders for update_weights_from_disk."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.rollout.weight_sync import disk_sync

pytestmark = pytest.mark.rollout


def tensors():
    torch.manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(64, 64) for i in range(6)} | {
        "lm_head.weight": torch.randn(10, 64)
    }


def test_bucketed_roundtrip_with_index_and_config(tmp_path, tiny_dir):
    ts = tensors()
    out = disk_sync.write_hf_folder(ts.items(), tmp_path / "v1", config_dir=tiny_dir, bucket_mb=0.03)
    index = json.loads((out / disk_sync.INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    # 16 KiB layers, 30 KiB buckets: one layer per shard, the 2.5 KiB head joins the last one
    assert len(shards) == 6 and shards[0] == "model-00001-of-00006.safetensors"
    assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["model.layers.5.w"]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ts.values())
    assert (out / "config.json").read_text() == (tiny_dir / "config.json").read_text()
    back = dict(disk_sync.iter_safetensors(out))
    assert back.keys() == ts.keys() and all(torch.equal(back[k], ts[k]) for k in ts)
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # no temp dirs left


def test_single_file_shared_storage_and_dtype(tmp_path):
    w = torch.randn(8, 4)
    out = disk_sync.write_hf_folder(
        [("model.embed_tokens.weight", w), ("lm_head.weight", w)], tmp_path / "tied", dtype=torch.bfloat16
    )
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    back = dict(disk_sync.iter_safetensors(out))
    assert back["lm_head.weight"].dtype == torch.bfloat16 and torch.equal(
        back["lm_head.weight"], w.bfloat16()
    )


def test_failure_midway_leaves_nothing(tmp_path):
    def stream():
        yield "a", torch.ones(100, 100)
        yield "b", torch.ones(100, 100)
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        disk_sync.write_hf_folder(stream(), tmp_path / "v2", bucket_mb=0.01)
    assert list(tmp_path.iterdir()) == []
    assert not disk_sync.is_complete(tmp_path / "v2")
    with pytest.raises(ValueError, match="given twice"):
        disk_sync.write_hf_folder([("a", torch.ones(1)), ("a", torch.ones(1))], tmp_path / "v3")
    with pytest.raises(ValueError, match="no tensors"):
        disk_sync.write_hf_folder([], tmp_path / "v4")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_and_prune(tmp_path):
    for v in range(4):
        disk_sync.write_hf_folder([("x", torch.full((2,), float(v)))], disk_sync.versioned_dir(tmp_path, v))
    with pytest.raises(FileExistsError):
        disk_sync.write_hf_folder([("x", torch.zeros(2))], disk_sync.versioned_dir(tmp_path, 3))
    disk_sync.write_hf_folder(
        [("x", torch.full((2,), 9.0))], disk_sync.versioned_dir(tmp_path, 3), overwrite=True
    )
    assert dict(disk_sync.iter_safetensors(disk_sync.versioned_dir(tmp_path, 3)))["x"].tolist() == [9.0, 9.0]
    removed = disk_sync.prune_versions(tmp_path, keep=2)
    assert [p.name for p in removed] == ["v00000000", "v00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(disk_sync.iter_safetensors(tmp_path))


def test_disk_transport_10_rounds_keeps_exactly_keep_versions(tmp_path, tiny_dir, tiny_model):
    """The trainer's disk transport: every round writes v<N>, the engine loads it, old versions are pruned;
    temp folders a killed writer left behind are removed (each would be a full model copy on the disk)."""
    from mcore_rl.rollout.local.engine import LocalEngine
    from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
    from mcore_rl.rollout.weight_sync.transports import SyncOptions, send_weights

    root = tmp_path / "sync"
    (root / "v00000007.tmp").mkdir(parents=True)  # crashed writer
    (root / "v00000007.tmp" / "shard-00000.safetensors").write_bytes(b"x" * 1000)
    (root / "v00000003.old").mkdir()
    (root / "notes").mkdir()  # not ours: left alone
    opts = SyncOptions(sync_dir=root, config_dir=tiny_dir, keep_versions=3)
    base = {k: v.detach().clone() for k, v in tiny_model.state_dict().items()}
    req = GenerationRequest([3, 4, 5], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    with LocalEngine(str(tiny_dir)) as eng:
        first = eng.generate([req])[0].output_ids
        for v in range(1, 11):
            scale = 1.0 if v == 10 else 1.0 + 0.5 * v  # rounds change the weights; the last restores them
            send_weights("disk", eng, ((k, t * scale) for k, t in base.items()), v, opts)
            assert eng.weight_version == v
            assert len([p for p in root.iterdir() if p.name.startswith("v")]) == min(v, 3)
        out = eng.generate([req])[0]
    assert sorted(p.name for p in root.iterdir()) == ["notes", "v00000008", "v00000009", "v00000010"]
    assert out.output_ids == first and out.weight_versions == [10] * 4  # v10 (= base weights) is what loaded
    with pytest.raises(ValueError, match="keep_versions=0"):
        SyncOptions(sync_dir=root, keep_versions=0)
