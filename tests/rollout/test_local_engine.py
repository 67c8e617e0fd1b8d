"""The in-process engine: log-prob convention, batch shrinking, continuous batching, n, seeds, stops, aborts,
pauses and weight updates (tiny random Llama; one SmolLM2 text test)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import GenerationRequest, RolloutEngine, SamplingParams, build_engine
from tests.rollout.conftest import forward_logprobs

pytestmark = pytest.mark.rollout


def wait_for(pred, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = LocalEngine(str(tiny_dir), seed=123)
    yield eng
    eng.close()


def req(prompt, rid=None, **sp) -> GenerationRequest:
    return GenerationRequest(list(prompt), SamplingParams(**sp), rid=rid)


def test_is_a_rollout_engine(engine, tiny_dir):
    assert isinstance(engine, RolloutEngine)
    other = build_engine("local", model_path=str(tiny_dir))
    try:
        assert isinstance(other, LocalEngine) and other.weight_version == 0
    finally:
        other.close()


def test_logprobs_equal_plain_forward_and_finished_rows_leave(engine, tiny_model):
    """Mixed lengths (left padding), temperatures, truncation, greedy, n=2, rows finishing at different steps."""
    reqs = [
        req(range(3, 6), temperature=0.7, max_new_tokens=4, n=2, ignore_eos=True),
        req(range(10, 22), temperature=1.3, top_p=0.8, max_new_tokens=12, ignore_eos=True),
        req([5, 9], temperature=1.0, top_k=7, max_new_tokens=7, ignore_eos=True),
        req(range(40, 47), temperature=0.0, max_new_tokens=9, ignore_eos=True),
    ]
    before = len(engine.stats.batch_sizes)
    samples = engine.generate(reqs)
    assert [s.sample_index for s in samples] == [0, 1, 0, 0, 0]
    temps = [0.7, 0.7, 1.3, 1.0, 0.0]
    for s, t in zip(samples, temps):
        ref = forward_logprobs(tiny_model, s.prompt_ids, s.output_ids, t)
        got = torch.tensor(s.output_logprobs)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert (got - ref).abs().max().item() < 1e-4, (s.rid, got, ref)
        assert s.finish_reason == "length" and s.weight_versions == [0] * len(s.output_ids)
    assert [len(s.output_ids) for s in samples] == [4, 4, 12, 7, 9]
    # decode steps: 5 rows until 4 tokens, then 3 until 7, 2 until 9, 1 until 12
    assert list(engine.stats.batch_sizes)[before:] == [5] * 3 + [3] * 3 + [2] * 2 + [1] * 3


def test_greedy_matches_argmax_and_topk1(engine, tiny_model):
    greedy = engine.generate([req([7, 8, 9], temperature=0.0, max_new_tokens=6, ignore_eos=True)])[0]
    ids = [7, 8, 9]
    for tok in greedy.output_ids:
        with torch.no_grad():
            assert tok == int(tiny_model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)
    topk1 = engine.generate([req([7, 8, 9], temperature=0.9, top_k=1, max_new_tokens=6, ignore_eos=True)])[0]
    assert topk1.output_ids == greedy.output_ids


def test_continuous_batching_merges_new_requests(engine, tiny_model):
    """A request arriving mid-generation joins the running batch; both stay exact."""
    first = engine.submit([req(range(20, 26), temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=1)])
    steps = engine.stats.steps
    wait_for(lambda: engine.stats.steps >= steps + 3)
    second = engine.submit([req(range(60, 75), temperature=0.8, max_new_tokens=10, ignore_eos=True)])
    a, b = first[0].result(timeout=60), second[0].result(timeout=60)
    assert max(engine.stats.batch_sizes) >= 2  # they really shared decode steps
    for s, t in ((a, 1.0), (b, 0.8)):
        ref = forward_logprobs(tiny_model, s.prompt_ids, s.output_ids, t)
        assert (torch.tensor(s.output_logprobs) - ref).abs().max().item() < 1e-4


def test_n_samples_and_seeds(engine):
    sp = dict(temperature=1.0, max_new_tokens=10, n=3, ignore_eos=True)
    a = engine.generate([req([4, 5, 6], rid="g", seed=7, **sp)])
    assert [s.sample_index for s in a] == [0, 1, 2] and all(s.rid == "g" for s in a)
    assert len({tuple(s.output_ids) for s in a}) == 3  # the n samples differ
    # same seed, different batch company -> identical samples
    b = engine.generate([req([9, 9], max_new_tokens=3), req([4, 5, 6], rid="g", seed=7, **sp)])[1:]
    assert [s.output_ids for s in b] == [s.output_ids for s in a]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.output_logprobs, t.output_logprobs)) < 1e-5
    c = engine.generate([req([4, 5, 6], seed=8, **sp)])
    assert [s.output_ids for s in c] != [s.output_ids for s in a]


def test_stop_token_ids_and_eos(engine):
    base = engine.generate([req([11, 12, 13], temperature=0.0, max_new_tokens=12, ignore_eos=True)])[
        0
    ].output_ids
    k = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    stop = base[k]
    s = engine.generate([req([11, 12, 13], temperature=0.0, max_new_tokens=12, stop_token_ids=[stop])])[0]
    assert s.output_ids == base[: k + 1] and s.finish_reason == "stop" and s.matched_stop == stop
    saved = engine._eos
    engine._eos = frozenset({stop})  # pretend the model's EOS is that token
    try:
        s = engine.generate([req([11, 12, 13], temperature=0.0, max_new_tokens=12)])[0]
        assert s.output_ids == base[: k + 1] and s.finish_reason == "stop"
        s = engine.generate([req([11, 12, 13], temperature=0.0, max_new_tokens=12, ignore_eos=True)])[0]
        assert s.output_ids == base and s.finish_reason == "length"
    finally:
        engine._eos = saved


def test_abort_by_rid_from_another_thread(engine):
    futs = engine.submit(
        [
            req([3, 4], rid="long", max_new_tokens=400, ignore_eos=True),
            req([5, 6], rid="short", max_new_tokens=30),
        ]
    )
    wait_for(lambda: engine.num_running == 2 and engine.stats.steps > 0)
    steps = engine.stats.steps
    wait_for(lambda: engine.stats.steps >= steps + 5)
    threading.Thread(target=engine.abort, args=("long",)).start()
    long, short = futs[0].result(timeout=60), futs[1].result(timeout=60)
    assert long.finish_reason == "abort" and 5 < len(long.output_ids) < 400
    assert len(long.output_logprobs) == len(long.output_ids) == len(long.weight_versions)
    assert short.finish_reason in ("length", "stop") and short.rid == "short"


def test_pause_in_place_update_resume_tags_versions(tiny_dir, tiny_alt_dir):
    from mcore_rl.rollout.weight_sync.disk_sync import iter_safetensors

    with LocalEngine(str(tiny_dir)) as eng:
        fut = eng.submit([req([3, 4, 5], max_new_tokens=300, ignore_eos=True)])[0]
        wait_for(lambda: eng.stats.steps >= 5)
        eng.pause("in_place")
        steps = eng.stats.steps
        time.sleep(0.05)
        assert eng.stats.steps == steps and not fut.done()  # really paused
        eng.update_weights(iter_safetensors(tiny_alt_dir), version=1)
        eng.resume()
        s = fut.result(timeout=60)
    k = s.weight_versions.index(1)
    assert 0 < k < len(s.output_ids) == 300
    assert s.weight_versions == [0] * k + [1] * (300 - k)


def test_pause_abort_holds_new_requests(tiny_dir):
    with LocalEngine(str(tiny_dir)) as eng:
        running = eng.submit([req([3, 4], max_new_tokens=400, ignore_eos=True)])[0]
        wait_for(lambda: eng.stats.steps >= 2)
        eng.pause("abort")
        assert running.done() and running.result().finish_reason == "abort"
        queued = eng.submit([req([3, 4], max_new_tokens=3)])[0]
        time.sleep(0.1)
        assert not queued.done()
        eng.resume()
        assert queued.result(timeout=30).finish_reason == "length"


def test_update_weights_changes_outputs_and_errors(tiny_dir, tiny_alt_dir, tiny_alt_model):
    from mcore_rl.rollout.weight_sync.disk_sync import iter_safetensors

    greedy = dict(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with LocalEngine(str(tiny_dir)) as eng, LocalEngine(str(tiny_alt_dir)) as alt:
        before = eng.generate([req([5, 6, 7], **greedy)])[0]
        expected = alt.generate([req([5, 6, 7], **greedy)])[0]
        assert before.output_ids != expected.output_ids
        eng.update_weights(iter_safetensors(tiny_alt_dir), version=3)
        after = eng.generate([req([5, 6, 7], **greedy)])[0]
        assert eng.weight_version == 3 and after.weight_versions == [3] * 8
        assert after.output_ids == expected.output_ids
        ref = forward_logprobs(tiny_alt_model, after.prompt_ids, after.output_ids, 1.0)
        assert (torch.tensor(after.output_logprobs) - ref).abs().max().item() < 1e-4
        eng.update_weights_from_disk(str(tiny_dir), version=4)
        assert eng.generate([req([5, 6, 7], **greedy)])[0].output_ids == before.output_ids
        with pytest.raises(KeyError, match="model.layers.0.mlp.up_proj.weightt"):
            eng.update_weights([("model.layers.0.mlp.up_proj.weightt", torch.zeros(1))], version=5)
        with pytest.raises(ValueError, match=r"shape mismatch for 'lm_head.weight'"):
            eng.update_weights([("lm_head.weight", torch.zeros(3, 3))], version=5)
        assert eng.weight_version == 4


def test_release_memory_and_bad_input(tiny_dir):
    with LocalEngine(str(tiny_dir)) as eng:
        eng.release_memory()
        with pytest.raises(RuntimeError, match="resume_memory"):
            eng.submit([req([1, 2], max_new_tokens=2)])
        eng.resume_memory()
        assert eng.generate([req([1, 2], max_new_tokens=2)])[0].finish_reason in ("length", "stop")
        with pytest.raises(ValueError, match="out of range"):
            eng.submit([req([1, 999], max_new_tokens=2)])
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            eng.submit([req([1, 2], stop=["x"])])
        assert eng.health()
    assert not eng.health()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        GenerationRequest([])


def test_smollm2_text_and_stop_string(smollm2_dir):
    """The real model: chat prompt -> text; a stop string ends the sample and is trimmed from the text."""
    from transformers import AutoModelForCausalLM

    with LocalEngine(str(smollm2_dir)) as eng:
        tok = eng.tokenizer
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "Count from 1 to 9, separated by spaces."}],
            add_generation_prompt=True,
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        free = eng.generate([req(prompt, temperature=0.0, max_new_tokens=24)])[0]
        assert "1" in free.text and "2" in free.text
        s = eng.generate([req(prompt, temperature=0.0, max_new_tokens=24, stop=["3"])])[0]
        assert s.finish_reason == "stop" and s.matched_stop == "3"
        assert s.output_ids == free.output_ids[: len(s.output_ids)] and "3" not in s.text and "2" in s.text
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        ref = forward_logprobs(model, prompt, free.output_ids, 1.0)
        assert (torch.tensor(free.output_logprobs) - ref).abs().max().item() < 1e-4


def engine_kwargs_from_yaml(name: str, **overrides) -> tuple[str, dict]:
    """What the trainer does with hydra_conf/rollout/<name>.yaml: resolve, pop its own keys, pass the rest."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from mcore_rl.config import ROLLOUT_SCHEMAS

    yaml = Path(__file__).resolve().parents[2] / "hydra_conf" / "rollout" / f"{name}.yaml"
    raw = OmegaConf.load(yaml)
    raw.pop("defaults")  # the yaml names its schema there: merge onto it as Hydra does
    rollout = OmegaConf.merge(OmegaConf.structured(ROLLOUT_SCHEMAS[name]), raw)
    cfg = OmegaConf.merge({"run": {"dir": "/tmp/mcore-rl-run"}}, {"rollout": rollout}, {"rollout": overrides})
    rc = OmegaConf.to_container(cfg.rollout, resolve=True)
    engine = rc.pop("engine")
    from mcore_rl.rollout.weight_sync.transports import TRAINER_KEYS

    for key in TRAINER_KEYS:
        rc.pop(key, None)
    return engine, rc


def test_local_yaml_builds_the_engine(tiny_dir):
    name, kwargs = engine_kwargs_from_yaml("local")
    with build_engine(name, model_path=str(tiny_dir), seed=5, **kwargs) as eng:
        assert isinstance(eng, LocalEngine)
        assert eng.generate([req([1, 2, 3], max_new_tokens=3, ignore_eos=True)])[0].num_output_tokens == 3
