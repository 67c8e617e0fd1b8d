"""`mcore-rl-eval MODEL --set SPEC [--set SPEC ...] [--env NAME ...]`: held-out evaluation of an HF folder, a run
directory or a Megatron checkpoint: n samples (an environment: n episodes) per prompt, mean@n and unbiased pass@k,
one table row per set or environment, results as jsonl.

Exit codes: 0 done; 2 bad input (unknown set, missing model, bad option), one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from mcore_rl.dtypes import BF16_MATMUL_MODES

SET_HELP = ("held-out set, repeatable: arithmetic | champ | reasoning_gym/NAME | hf/HUB_ID | local .jsonl/.json/"
            ".parquet | data .yaml, each optionally followed by :key=value,... (e.g. arithmetic:max_operand=50)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcore-rl-eval", description=__doc__.splitlines()[0])
    p.add_argument("model", help="HF folder, run directory, or Megatron checkpoint folder")
    p.add_argument("--set", dest="sets", action="append", default=None, help=SET_HELP + " (default: arithmetic)")
    p.add_argument("--env", dest="envs", action="append", default=None, metavar="NAME[:key=value,...]",
                   help="an environment's held-out episodes, repeatable: NAME (hydra_conf/env/NAME.yaml) or FILE.yaml, "
                        "optionally :key=value,... overriding its keys (e.g. calculator:max_turns=2)")
    p.add_argument("--plugin", dest="plugins", action="append", default=None, metavar="MODULE",
                   help="import this module first (its registered environments, data kinds, rewards), repeatable; "
                        "MCORE_RL_PLUGINS and a run directory's own plugins (its config.yaml) are imported too")
    p.add_argument("--num-prompts", type=int, default=32, help="first N prompts of each set; 0 = all (default 32)")
    p.add_argument("-n", "--samples", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--k", type=int, action="append", default=None,
                   help="pass@k to report, repeatable, k <= n (default: 1..n for n <= 16, else powers of 2 and n)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=777, help="prompt i is sampled with seed + i")
    p.add_argument("--engine", default=None, help="rollout engine (registry name; default: the embedded one)")
    p.add_argument("--rollout", default=None, metavar="NAME|FILE.yaml",
                   help="take the engine and its settings from a rollout config, as training's `rollout=NAME` does "
                        "(hydra_conf/rollout/NAME.yaml, e.g. sglang; --engine-arg overrides its keys)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine constructor argument (YAML value), repeatable, e.g. dtype=bfloat16")
    p.add_argument("--bf16-matmul", choices=BF16_MATMUL_MODES, default="auto",
                   help="a bf16 embedded engine on a CPU without bf16 matrix hardware: auto (bf16 products through "
                        "fp32 GEMMs where torch's bf16 matmul is slower, measured) | fp32 | native; as model.bf16_matmul")
    p.add_argument("--checkpoint", action="store_true",
                   help="run directory: evaluate its latest checkpoint even when an hf/ export exists")
    p.add_argument("--hf-config", default=None, help="HF config + tokenizer folder for a Megatron checkpoint")
    p.add_argument("--export-dir", default=None, help="keep checkpoint exports here (default: a temp dir removed at exit)")
    p.add_argument("--out", default="eval_results.jsonl", help="append one summary line per set here")
    p.add_argument("--samples-out", default=None, help="also write every prompt's responses and verdicts here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def default_ks(n: int) -> list[int]:
    if n <= 16:
        return list(range(1, n + 1))
    return sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n})


def _engine_kwargs(items: list[str]) -> dict:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def rollout_engine(name: str | None, engine: str | None, overrides: dict,
                   work_dir: str | Path | None = None) -> tuple[str, dict]:
    """(engine name, constructor kwargs) from a rollout yaml (training's `rollout=` group or a file) + overrides.
    The trainer-only keys (weight sync) are dropped: evaluation never updates weights. `${run.dir}` (launcher
    logs) resolves to `work_dir`, the invocation's scratch folder (removed when the evaluation ends)."""
    if name is None:
        return engine or "local", overrides
    from omegaconf import OmegaConf

    from mcore_rl.config.paths import CONFIG_DIR
    from mcore_rl.rollout.weight_sync.transports import TRAINER_KEYS

    path = Path(name) if name.endswith((".yaml", ".yml")) else Path(CONFIG_DIR) / "rollout" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (Path(CONFIG_DIR) / "rollout").glob("*.yaml"))
        raise ValueError(f"--rollout {name}: no such rollout config {path} (known: {', '.join(known)})")
    from omegaconf.errors import OmegaConfBaseException

    from mcore_rl.config import ROLLOUT_SCHEMAS

    raw = OmegaConf.load(path)
    # the group's Hydra schema line (`/schema/rollout/<engine>@_here_`) names the engine when the yaml does not:
    # the same schema is applied here by hand
    named = [str(d).split("/")[-1].split("@")[0] for d in raw.pop("defaults", []) if "schema/rollout/" in str(d)]
    raw.setdefault("engine", named[0] if named else "local")
    schema = ROLLOUT_SCHEMAS.get(raw.engine)
    try:
        node = OmegaConf.merge(OmegaConf.structured(schema), raw) if schema else raw
    except OmegaConfBaseException as e:
        raise ValueError(f"--rollout {name}: {str(e).splitlines()[0]}") from None
    cfg = OmegaConf.merge({"run": {"dir": str(work_dir or tempfile.gettempdir())}}, {"rollout": node})
    rc = OmegaConf.to_container(cfg.rollout, resolve=True)
    for key in (*TRAINER_KEYS, "bucket_mb", "nccl"):
        rc.pop(key, None)
    if isinstance(rc.get("launcher"), dict):  # no trainer shares this node: servers may take every visible GPU
        rc["launcher"] = {**rc["launcher"], "trainer_gpus": 0}
    rc.update(overrides)
    return engine or rc.pop("engine", "local"), {k: v for k, v in rc.items() if k != "engine"}


def _build_engine(name: str, kwargs: dict, model_dir: Path, seed: int, bf16_matmul: str):
    from mcore_rl.rollout.protocol import build_engine

    if name == "local":  # the embedded engine computes here: bf16 products at fp32 speed where needed
        from mcore_rl.policy.precision import configure_bf16_matmul

        configure_bf16_matmul(bf16_matmul, {str(kwargs.get("dtype"))})
    try:
        return build_engine(name, model_path=str(model_dir), seed=seed, **kwargs)
    except (KeyError, TypeError) as e:  # unknown engine name / constructor argument
        raise ValueError(f"--engine {name}: {str(e).strip(chr(34) + chr(39))}") from None


def load_plugins(model: str, listed: list[str] | None) -> list[str]:
    """Import --plugin's modules, MCORE_RL_PLUGINS' and, when `model` is a run directory (or its `hf/` export or
    one of its checkpoints), the plugins its run loaded (config.yaml `plugins`), before any set or environment name
    is resolved. A plugin that fails to import is a ValueError: one line, exit 2."""
    import yaml

    from mcore_rl import plugins

    modules = list(listed or [])
    path = Path(model)
    for run_dir in (path, path.parent, path.parent.parent):
        marks = (run_dir / "metrics.jsonl").is_file() or (run_dir / "checkpoints").is_dir()
        if marks and (run_dir / "config.yaml").is_file():
            modules += plugins.parse((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("plugins"))
            break
    return plugins.load([*plugins.from_env(), *modules])


def format_table(rows: list[tuple[str, dict[str, float]]], ks: list[int], n: int) -> str:
    head = ["set", "prompts", f"mean@{n}", *[f"pass@{k}" for k in ks], "len", "trunc"]
    body = [[spec, f"{int(s['num_prompts'])}", f"{s['mean_at_n']:.3f}", *[f"{s[f'pass_at_{k}']:.3f}" for k in ks],
             f"{s['response_len']:.1f}", f"{s['truncation_rate']:.2f}"] for spec, s in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head, *body]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def run(a: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from mcore_rl.data import render_prompt
    from mcore_rl.evaluation.envs import evaluate_env, format_env_table, load_env
    from mcore_rl.evaluation.model_source import resolve_model
    from mcore_rl.evaluation.runner import GenerationConfig, HeldOutSet, evaluate_set
    from mcore_rl.evaluation.sets import load_set
    n = a.samples
    if n < 1:
        raise ValueError(f"-n/--samples must be >= 1; got {n}")
    ks = sorted(set(a.k)) if a.k else default_ks(n)
    if any(not 1 <= k <= n for k in ks):
        raise ValueError(f"--k must satisfy 1 <= k <= n={n}; got {ks}")
    load_plugins(a.model, a.plugins)
    specs = a.sets or ([] if a.envs else ["arithmetic"])
    sets = [(spec, load_set(spec, a.num_prompts)) for spec in specs]  # bad specs fail before the model loads
    envs = []
    # one scratch folder per invocation (a checkpoint's HF export, launcher logs), removed at the end: repeated
    # evaluations of checkpoints must not fill the disk with ~0.5 GB exports nobody asked to keep (--export-dir)
    scratch = tempfile.TemporaryDirectory(prefix="mcore_rl_eval_")
    try:
        envs = [load_env(spec, a.num_prompts) for spec in a.envs or []]
        model = resolve_model(a.model, a.hf_config, a.checkpoint, a.export_dir or scratch.name)
        print(f"model: {model.hf_dir} ({model.kind}, from {model.origin})", file=sys.stderr)
        tok_dir = model.hf_dir if any(model.hf_dir.glob("tokenizer*")) else model.tokenizer_dir
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        engine_name, engine_kwargs = rollout_engine(a.rollout, a.engine, _engine_kwargs(a.engine_arg), scratch.name)
        engine = _build_engine(engine_name, engine_kwargs, model.hf_dir, a.seed, a.bf16_matmul)
        gen = GenerationConfig(n=n, temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens,
                               seed=a.seed)
        results = []
        try:
            stop_ids = [t for t in {tokenizer.eos_token_id} if t is not None]
            for spec, es in sets:
                hs = HeldOutSet(es.name, [render_prompt(tokenizer, r) for r in es.records], es.records, es.scorer,
                                prefixed=False)
                results.append(evaluate_set(engine, hs, gen, stop_ids, ks, spec, progress=not a.no_progress))
            env_results = [evaluate_env(engine, tokenizer, es, gen, stop_ids, ks) for es in envs]
        finally:
            engine.close()
    finally:
        for _, es in sets:
            es.scorer.close()
        for ev in envs:
            ev.env.close()
        scratch.cleanup()
    if results:
        print(format_table([(r.spec, r.summary) for r in results], ks, n))
    if env_results:
        print(format_env_table([(r.spec, r.summary) for r in env_results], ks, n))
    _write_results(a, model, results, env_results, envs)
    return 0


def _write_results(a: argparse.Namespace, model, results: list, env_results: list, envs: list) -> None:
    """One summary line per set / environment appended to --out; every prompt's responses and verdicts (an
    environment's: every episode) to --samples-out. An environment's line says `"env": SPEC` instead of `"set"`
    and carries its config; `max_new_tokens` is then its per-turn limit."""
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.time()
    common = {"time": stamp, "model": str(model.origin), "model_kind": model.kind, "temperature": a.temperature,
              "seed": a.seed}
    with out.open("a") as f:
        for r in results:
            f.write(json.dumps({**common, "set": r.spec, "source": r.name, "max_new_tokens": a.max_new_tokens,
                                **r.summary}) + "\n")
        for r, ev in zip(env_results, envs):
            f.write(json.dumps({**common, "env": r.spec, "source": r.name,
                                "max_new_tokens": ev.env.config.max_new_tokens, "env_config": ev.config,
                                **r.summary}) + "\n")
    print(f"wrote {out}")
    if a.samples_out:
        with Path(a.samples_out).open("w") as f:
            for r in results:
                for row in r.per_prompt:
                    f.write(json.dumps({"set": r.spec, **row}) + "\n")
            for r in env_results:
                for row in r.per_prompt:
                    f.write(json.dumps({"env": r.spec, **row}) + "\n")
        print(f"wrote {a.samples_out}")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    a = _parser().parse_args(argv)
    from mcore_rl.evaluation.model_source import ModelSourceError

    try:
        return run(a)
    except (ValueError, FileNotFoundError, ModelSourceError) as e:
        print(f"mcore-rl-eval: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
