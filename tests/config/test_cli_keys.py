"""Keys no other test set through the CLI, each set here and its effect asserted.

Builder-level checks compose the same override strings the CLI takes and assert what the consumer built; one
`mcore-rl-train model=tiny` run sets the keys the trainer itself acts on (~30-50 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.config.keyscan import REPO, compose

pytestmark = pytest.mark.e2e


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ---- data: builders read every key (no model needed) ------------------------------------------------------------
def test_arithmetic_keys_shape_the_prompts():
    from mcore_rl.data.registry import build_dataset

    cfg = compose(["data.size=5", "data.seed=3", "data.ops=[*]", "data.min_operand=2", "data.max_operand=3",
                   "data.question='Compute {a} {op} {b}.'", "data.prompt_template='Q: {question}'",
                   "data.system_prompt=Be brief.", "data.prompt_format=chat"])
    ds = build_dataset(cfg.data)
    assert len(ds) == 5
    for r in ds:
        a, b = r.metadata["a"], r.metadata["b"]
        assert 2 <= a <= 3 and 2 <= b <= 3 and r.metadata["op"] == "*" and r.answer == str(a * b)
        assert r.prompt[0] == {"role": "system", "content": "Be brief."}
        assert r.prompt[-1]["content"] == f"Q: Compute {a} * {b}."
    other = build_dataset(compose(["data.size=5", "data.seed=4", "data.max_operand=1000"]).data)
    assert [r.answer for r in other] != [r.answer for r in ds]
    text = build_dataset(compose(["data.size=2", "data.prompt_format=text"]).data)
    assert all(isinstance(r.prompt, str) for r in text)


def test_jsonl_keys(tmp_path):
    from mcore_rl.data.registry import build_dataset

    rows = [{"q": {"text": f"What is {i}+{i}?"}, "sol": f"work #### {2 * i}", "uid": f"u{i}", "src": "t"}
            for i in range(5)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = build_dataset(compose(["data=jsonl", f"data.path={path}", "data.prompt_field=q.text", "data.answer_field=sol",
                                "data.id_field=uid", "data.metadata_fields=[src]", "data.answer_transform=gsm8k",
                                "data.limit=3", "data.prompt_format=text"]).data)
    assert [r.prompt_id for r in ds] == ["u0", "u1", "u2"]
    assert [r.answer for r in ds] == ["0", "2", "4"] and ds[1].metadata["src"] == "t"
    wrapped = tmp_path / "train.json"
    wrapped.write_text(json.dumps({"rows": rows}))
    ds = build_dataset(compose(["data=jsonl", f"data.path={wrapped}", "data.json_field=rows", "data.prompt_field=q.text",
                                "data.answer_field=sol", "data.split=train", "data.subset=null",
                                "data.revision=null"]).data)
    assert len(ds) == 5


def test_reasoning_gym_and_champ_keys():
    from mcore_rl.data.registry import build_dataset

    pytest.importorskip("reasoning_gym")
    ds = build_dataset(compose(["data=reasoning_gym", "data.name=basic_arithmetic", "data.size=4", "data.seed=1",
                                "data.options.min_digits=1", "data.options.max_digits=1",
                                "data.options.operators=[+]"]).data)
    assert len(ds) == 4
    for r in ds:  # operators=[+], one-digit terms: "a + b" with |a|, |b| <= 9
        terms = r.metadata["expression"].strip("() ").split(" + ")
        assert len(terms) == 2 and all(abs(int(x)) <= 9 for x in terms), r.metadata["expression"]
        assert int(r.answer) == sum(int(x) for x in terms)
    pytest.importorskip("champ_dataset")
    champ = build_dataset(compose(["data=champ", "data.version=v0", "data.categories=[Inequality]"]).data)
    assert len(champ) > 0 and {r.metadata.get("category") for r in champ} <= {"Inequality"}


# ---- reward: the builder takes every key ----------------------------------------------------------------------
def test_reward_keys_change_scores():
    from mcore_rl.rewards import build_reward

    cfg = compose(["reward=math_format", "reward.name=math_verify+format", "reward.weights.format=0.5",
                   "reward.format.check=boxed", "reward.format.max_chars=64", "reward.math_verify.num_workers=1",
                   "reward.math_verify.timeout_s=5", "reward.math_verify.max_chars=64",
                   "reward.math_verify.max_answer_chars=16", "reward.math_verify.max_nesting=8",
                   "reward.math_verify.mp_context=spawn", "reward.math_verify.max_tasks_per_worker=2",
                   "reward.math_verify.startup_timeout_s=120", "reward.math_verify.memory_limit_mb=2048"])
    fn = build_reward(cfg.reward)
    try:
        res = fn.score(["so \\boxed{4}", "4", "x" * 200 + " \\boxed{4}"], ["4", "4", "4"])
    finally:
        fn.close()
    # boxed: 1 + 0.5; bare number: 1 (format=boxed refuses it); the boxed answer 200 chars back is read (tail)
    assert [r.score for r in res] == [1.5, 1.0, 1.5]


# ---- model / optim / parallel: what the trainer's builders get -------------------------------------------------
def test_model_optim_parallel_keys_reach_the_builders():
    from mcore_rl.config import load_config
    from mcore_rl.trainer.setup import build_config, policy_config

    cfg = load_config(compose(["model=tiny_moe", "model.source=tiny", "model.moe.aux_loss_coeff=0.01", "model.lm_head_fp32=true",
                   "model.tiny.seed=3", "parallel.pp=1", "parallel.ep=1", "optim.lr=3e-4", "optim.min_lr=1e-5",
                   "optim.adam_beta1=0.8", "optim.adam_beta2=0.95", "optim.adam_eps=1e-6", "optim.weight_decay=0.1",
                   "optim.clip_grad=0.5", "optim.warmup_steps=2", "optim.decay_style=cosine",
                   "optim.use_distributed_optimizer=true", "trainer.steps=7"]))
    b = build_config(cfg)
    assert (b.moe_aux_loss_coeff, b.lm_head_fp32, b.pp, b.ep) == (0.01, True, 1, 1)
    p = policy_config(cfg)
    o = p.optim
    assert (o.lr, o.min_lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay, o.clip_grad, o.warmup_steps,
            o.decay_style, o.use_distributed_optimizer, p.decay_steps) == (3e-4, 1e-5, 0.8, 0.95, 1e-6, 0.1, 0.5,
                                                                          2, "cosine", True, 7)
    assert cfg.model.tiny["seed"] == 3


# ---- the trainer: one CLI run ----------------------------------------------------------------------------------
def test_trainer_keys_through_the_cli(tmp_path):
    run_dir, ws = tmp_path / "run", tmp_path / "ws"
    cmd = [sys.executable, "-m", "mcore_rl.train", "model=tiny", "seed=7", "trainer.steps=2",
           "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2", "trainer.max_new_tokens=6",
           "trainer.temperature=1.3", "trainer.top_p=0.9", "trainer.token_budget=24", "trainer.pack_rows=true", "trainer.deterministic=true",
           "trainer.save_every=1", "trainer.keep_checkpoints=1", "trainer.export_hf=false",
           "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
           "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=1", "optim.decay_style=linear",
           "algorithm.entropy_coef=0.01",
           "eval.every=1", "eval.num_prompts=2", "eval.samples_per_prompt=2", "eval.max_new_tokens=3",
           "eval.temperature=1.0", "eval.seed=5", "eval.data={kind:arithmetic,size:2,seed:11,ops:[-]}",
           "data.size=2", "data.sampler.shuffle=false", "data.sampler.seed=1",
           "rollout.engine=local", "rollout.device=cpu", "rollout.dtype=float32", "rollout.max_batch_size=1",
           "rollout.num_threads=1", "rollout.return_text=true", "rollout.sync_mode=disk", f"rollout.sync_dir={ws}",
           "rollout.keep_versions=1", "rollout.weight_layout=in", "model.load_check.enabled=false",
           f"run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = _records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    # save_every=1 + keep_checkpoints=1: both steps saved, one kept; export_hf/tensorboard/plot off
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000002"]
    assert not (run_dir / "hf").exists() and not (run_dir / "tensorboard").exists()
    assert not (run_dir / "curves.png").exists()
    # disk sync into rollout.sync_dir, keep_versions=1
    assert [p.name for p in ws.iterdir() if p.name.startswith("v")] == ["v00000002"]
    # warmup 1 then linear decay towards min_lr: the logged lr moves inside [min_lr, lr]
    lrs = [r["lr"] for r in recs]
    assert all(1e-4 <= x <= 1e-3 for x in lrs) and lrs[0] != lrs[1], lrs
    # trainer.max_new_tokens / eval.max_new_tokens / eval.every=1 / eval.num_prompts
    assert all(r["response_len_max"] <= 6 for r in recs)
    evals = _records(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2] and all(e["response_len"] <= 3 for e in evals)
    assert all(e["num_prompts"] == 2 and e["k"] == 2 for e in evals)
    # data.size=2 with 2 prompts per update: the second update starts a new epoch
    assert recs[-1]["data_epoch"] >= 1
    assert "load check skipped: model.load_check.enabled=false" in proc.stderr
    assert "micro-batches: rows packed without pad tokens (trainer.pack_rows=true)" in proc.stderr
    # rollout.weight_layout=in: the engine decodes on [in, out] weights, and the synced versions landed in them
    assert "local engine: decode weights stored [in, out] (rollout.weight_layout)" in proc.stderr
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert (saved.seed, saved.trainer.top_p, saved.trainer.temperature) == (7, 0.9, 1.3)

    # again in the same run.dir: resume=never starts over at update 1 (the checkpoint is ignored), and
    # sync_weights=false leaves the engine on its initial weights (no new version folder)
    again = [c for c in cmd if not c.startswith(("trainer.steps=", "eval.every="))]
    proc = subprocess.run([*again, "trainer.steps=1", "eval.every=0", "trainer.resume=never",
                           "trainer.sync_weights=false"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = _records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 1]
    # with sync on, update 1 would have written v00000001 (and pruned v00000002: keep_versions=1)
    assert [p.name for p in ws.iterdir() if p.name.startswith("v")] == ["v00000002"]


def _free_port_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # ~2-3 min on 2 cores: one stand-in server (mcore-rl-serve) launched by the trainer
def test_sglang_keys_through_the_cli(tmp_path):
    key = "cfg-test-key-4711"
    key_file = tmp_path / "api_key"
    key_file.write_text(key)
    key_file.chmod(0o600)
    run_dir, ws, logs = tmp_path / "run", tmp_path / "ws", tmp_path / "logs"
    cmd = [sys.executable, "-m", "mcore_rl.train", "model=tiny", "rollout=sglang", "rollout.engine=sglang",
           "rollout.launcher.server=mcore-rl-serve", "rollout.launcher.num_servers=1", "rollout.launcher.base_port=0",
           "rollout.launcher.host=127.0.0.1", "rollout.launcher.tp_size=1", f"rollout.launcher.log_dir={logs}",
           "rollout.launcher.max_restarts=1", "rollout.launcher.extra_args=[--num-threads,1]",
           "rollout.launcher.health_timeout_s=240", f"rollout.api_key_file={key_file}", "rollout.batch_size=2",
           "rollout.max_concurrency=4", "rollout.timeout_s=300", "rollout.control_timeout_s=120", "rollout.retries=2",
           "rollout.deterministic=true", "rollout.tp_size=1", "rollout.bucket_mb=64", f"rollout.sync_dir={ws}",
           "rollout.keep_versions=1", "trainer.steps=2", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
           "trainer.max_new_tokens=6", "eval.num_prompts=0", "logging.progress=false", "logging.plot=false",
           "trainer.export_hf=false", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_free_port_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _records(run_dir / "metrics.jsonl")] == [1, 2]
    servers = json.loads((logs / "servers.json").read_text())  # rollout.launcher.log_dir
    assert len(servers) == 1 and servers[0]["url"].startswith("http://127.0.0.1:")
    assert [p.name for p in ws.iterdir() if p.name.startswith("v")] == ["v00000002"]  # sync_dir + keep_versions
    server_log = (logs / "server0.log").read_text()
    assert key not in proc.stderr and key not in server_log


# ---- algorithm: every key through the override grammar into the built algorithm's typed config ----------------
# (what each key DOES is asserted by tests/algorithms on the built objects; here: the CLI reaches them)
ALGORITHM_OVERRIDES = {
    "grpo": ["algorithm.adv_eps=1e-5", "algorithm.adv_std_norm=batch", "algorithm.adv_std_unbiased=false",
             "algorithm.batch_std_source=rewards", "algorithm.dual_clip_c=3.0", "algorithm.eps_low=0.1",
             "algorithm.eps_high=0.3", "algorithm.filter_zero_variance=true", "algorithm.max_response_len=64",
             "algorithm.overlong_buffer_len=8", "algorithm.overlong_penalty_factor=0.5",
             "algorithm.renorm_dropped=deferred", "algorithm.retire_pass_rate=0.9", "algorithm.old_logp_source=recompute",
             "algorithm.correction.mode=tis", "algorithm.correction.level=sequence", "algorithm.correction.ratio=old",
             "algorithm.correction.tis_max=3.0", "algorithm.correction.tis_min=0.1", "algorithm.correction.low=0.4",
             "algorithm.correction.high=2.5", "algorithm.correction.veto_threshold=1e-4",
             "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=2"],
    "mu_grpo": ["algorithm.schedule=staged", "algorithm.updates_per_stage=2",
                "algorithm.nav_scope=seq", "algorithm.nav_delta=0.001"],
    "scalerl": ["algorithm.eps_min=0.1", "algorithm.eps_max=4.0"],
    "p3o": ["algorithm.ess_scope=batch", "algorithm.ess_eps=1e-6"],
    "ppo_ewma": ["algorithm.ewma_beta=0.5", "algorithm.objective=original", "algorithm.ti_level=token",
                 "algorithm.ti_low=0.9", "algorithm.ti_high=1.1", "algorithm.ti_tis_max=2.0",
                 "algorithm.imp_samp_max=50.0", "algorithm.auto_reset=false", "algorithm.reset_keep_rate=0.3",
                 "algorithm.reset_clip_frac=0.6"],
    "rloo": ["algorithm.ratio_level=token"],
    "reinforce_pp": ["algorithm.baseline=group", "algorithm.reward_kl_coef=0.05", "algorithm.reward_kl_estimator=k3"],
}


# keys only another mode reads: the same check on a second update path
OTHER_PATHS = {
    "grpo/mis": ("grpo", ["algorithm.correction.mode=mis", "algorithm.correction.low=0.3",
                          "algorithm.correction.high=3.0"]),
    "ppo_ewma/decoupled": ("ppo_ewma", ["algorithm.objective=decoupled", "algorithm.ti_tis_max=1.5"]),
    "ppo_ewma/exact": ("ppo_ewma", ["algorithm.old_logp_source=snapshot", "algorithm.ti_bounds=auto",
                                    "algorithm.ti_auto_quantile=0.8", "algorithm.ti_auto_k=4.0",
                                    "algorithm.ti_auto_max=0.3"]),
    "ppo_ewma/exact_fixed": ("ppo_ewma", ["algorithm.old_logp_source=snapshot", "algorithm.ti_bounds=fixed"]),
}
CASES = {**{n: (n, o) for n, o in ALGORITHM_OVERRIDES.items()}, **OTHER_PATHS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_algorithm_keys_reach_the_built_algorithm(case):
    import yaml

    from mcore_rl.algorithms import build_algorithm

    name, overrides = CASES[case]
    alg = build_algorithm(compose([f"algorithm={name}", *overrides]).algorithm)
    for o in overrides:
        key, value = o.split("=", 1)
        got = alg.config
        for part in key.split(".")[1:]:
            got = getattr(got, part)
        want = yaml.safe_load(value)
        assert got == (float(want) if isinstance(got, float) else want), (key, got)
    loss = _one_update(alg)  # and the algorithm acts with them: every key is read on its update path
    assert torch.isfinite(loss), (name, loss)


def _one_update(alg) -> torch.Tensor:
    """An update's algorithm calls on a small synthetic batch (two groups of two): advantages, token weights,
    whole-batch statistics, the loss with every anchor it needs, accumulation and the post-step decision."""
    from mcore_rl.algorithms import TokenBatch

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 5)
    gid = torch.tensor([0, 0, 1, 1])
    adv = alg.advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), gid, lengths=mask.sum(1))
    logp = (-torch.rand(4, 5, generator=g)).requires_grad_()
    near = logp.detach() + 0.05 * torch.randn(4, 5, generator=g)
    alg.begin_update(near if alg.needs_old_logp else None, near if alg.needs_prox_logp else None, near, mask)
    alg.begin_step(logp.detach(), near, mask)
    tb = TokenBatch(logp=logp, mask=mask, advantages=adv.advantages[:, None] * mask, rollout_logp=near,
                    token_weight=alg.token_weights(mask, gid, keep=adv.keep),
                    old_logp=near if alg.needs_old_logp else None, prox_logp=near if alg.needs_prox_logp else None,
                    ref_logp=near if alg.needs_ref_logp else None,
                    entropy=torch.rand(4, 5, generator=g) if alg.needs_entropy else None)
    loss, metrics = alg.loss(tb)
    loss.backward()
    metrics.update(alg.finish_accumulation().metrics)
    alg.after_optimizer_step(metrics)
    return loss.detach()
