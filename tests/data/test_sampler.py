"""PromptSampler: seeded epochs, exact resume, skip callback."""

import pytest
import torch

from mcore_rl.data import PromptRecord, PromptSampler, build_dataset, build_sampler

pytestmark = pytest.mark.rollout


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(f"p{i}", f"question {i}", str(i)) for i in range(n)]


def _ids(batch):
    return [r.prompt_id for r in batch]


def test_epochs_cover_every_prompt_once_and_reshuffle():
    data = _records(12)
    s = PromptSampler(data, batch_size=4, seed=3)
    epoch0 = [i for _ in range(3) for i in _ids(s.next_batch())]
    epoch1 = [i for _ in range(3) for i in _ids(s.next_batch())]
    assert sorted(epoch0) == sorted(epoch1) == sorted(r.prompt_id for r in data)
    assert epoch0 != epoch1 and epoch0 != [r.prompt_id for r in data]
    assert s.epoch == 1 and s.position == 12
    other = PromptSampler(data, batch_size=4, seed=4)
    assert _ids(other.next_batch()) != epoch0[:4]
    plain = PromptSampler(data, batch_size=5, shuffle=False)
    assert _ids(plain.next_batch()) == ["p0", "p1", "p2", "p3", "p4"]
    plain.next_batch()
    assert _ids(plain.next_batch()) == ["p10", "p11", "p0", "p1", "p2"]  # batches run across epochs


def test_resume_yields_the_same_batches_as_an_uninterrupted_run(tmp_path):
    data = _records(10)
    ref = PromptSampler(data, batch_size=3, seed=7)
    expected = [_ids(ref.next_batch()) for _ in range(12)]  # spans 3+ epochs

    run = PromptSampler(data, batch_size=3, seed=7)
    got = [_ids(run.next_batch()) for _ in range(5)]
    torch.save(run.state_dict(), tmp_path / "sampler.pt")
    resumed = PromptSampler(data, batch_size=3, seed=7)
    resumed.load_state_dict(torch.load(tmp_path / "sampler.pt", weights_only=True))
    got += [_ids(resumed.next_batch()) for _ in range(7)]
    assert got == expected
    assert resumed.state_dict() == ref.state_dict()


def test_resume_with_skip_callback_matches():
    data = _records(9)
    retired = {"p1", "p4", "p7"}
    ref = PromptSampler(data, batch_size=4, seed=1, skip=retired.__contains__)
    expected = [_ids(ref.next_batch()) for _ in range(6)]
    assert all(not (set(b) & retired) for b in expected)
    run = PromptSampler(data, batch_size=4, seed=1, skip=retired.__contains__)
    first = [_ids(run.next_batch()) for _ in range(2)]
    resumed = PromptSampler(data, batch_size=4, seed=1, skip=retired.__contains__)
    resumed.load_state_dict(run.state_dict())
    assert first + [_ids(resumed.next_batch()) for _ in range(4)] == expected


def test_skip_everything_raises_instead_of_spinning():
    s = PromptSampler(_records(5), batch_size=2, skip=lambda pid: True)
    with pytest.raises(RuntimeError, match="all 5 prompts are skipped"):
        s.next_batch()


def test_state_from_another_dataset_or_seed_is_rejected():
    s = PromptSampler(_records(6), batch_size=2, seed=0)
    s.next_batch()
    with pytest.raises(ValueError, match="seed is 0 in the checkpoint but 1 now"):
        PromptSampler(_records(6), batch_size=2, seed=1).load_state_dict(s.state_dict())
    renamed = [PromptRecord(f"q{i}", "x", "1") for i in range(6)]
    with pytest.raises(ValueError, match="fingerprint"):
        PromptSampler(renamed, batch_size=2, seed=0).load_state_dict(s.state_dict())


def test_build_sampler_reads_the_data_yaml_section():
    cfg = {"kind": "arithmetic", "size": 20, "sampler": {"seed": 5, "shuffle": False}}
    ds = build_dataset(cfg)
    s = build_sampler(ds, cfg, batch_size=4)
    assert (s.seed, s.shuffle) == (5, False) and _ids(s.next_batch()) == [f"arith-s0-{i}" for i in range(4)]
    with pytest.raises(ValueError, match=r"data.sampler: unknown option\(s\) \['sed'\]"):
        build_sampler(ds, {"sampler": {"sed": 1}}, batch_size=4)
