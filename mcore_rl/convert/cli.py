"""`mcore-rl-convert`: hf-to-mcore, mcore-to-hf, verify, lora-to-peft, lora-merge.

Exit codes: 0 success, 1 verify above tolerance, 2 bad input / refused / failed conversion (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from mcore_rl.convert.common import ConvertError, parse_size


@dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (local processes)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks (local processes)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (MoE models; runs tp*pp*ep local processes)")


def _hf_to_mcore_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="checkpoint folder to create")
    _parallel_args(p)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="checkpoint dtype (default: the HF weights' dtype)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def _run_hf_to_mcore(a: argparse.Namespace) -> int:
    from mcore_rl.convert.hf_to_mcore import hf_to_mcore

    t0 = time.perf_counter()
    out = hf_to_mcore(a.hf, a.out, a.tp, a.pp, a.dtype, a.force, progress=not a.quiet, ep=a.ep)
    print(f"wrote {out} (tp={a.tp} pp={a.pp} ep={a.ep}, loads at any TP/PP/EP) in {time.perf_counter() - t0:.2f}s")
    return 0


def _mcore_to_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="Megatron torch_dist checkpoint folder")
    p.add_argument("--out", required=True, help="HF folder to create")
    p.add_argument("--hf-config", default=None,
                   help="HF config folder/file (default: the copy stored in the checkpoint)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="output dtype (default: the original HF dtype, so a round trip is bit-exact)")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 500MB (default 2GB)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def _run_mcore_to_hf(a: argparse.Namespace) -> int:
    from mcore_rl.convert.mcore_to_hf import mcore_to_hf

    t0 = time.perf_counter()
    out = mcore_to_hf(a.ckpt, a.out, a.hf_config, a.dtype, parse_size(a.max_shard_size), a.force,
                      progress=not a.quiet)
    print(f"wrote {out} in {time.perf_counter() - t0:.2f}s")
    return 0


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf", required=True, help="HF model folder (the reference, run with transformers)")
    p.add_argument("--ckpt", required=True, help="Megatron torch_dist checkpoint folder")
    _parallel_args(p)
    p.add_argument("--tol", type=float, default=1e-4, help="max |logit difference| allowed (fp32)")
    p.add_argument("--prompt", default=None, help="text to run (default: a GSM8K-style question)")
    p.add_argument("--tokens", type=int, default=None,
                   help="run N seeded random token ids instead of a prompt (e.g. beyond the original context)")


def _run_verify(a: argparse.Namespace) -> int:
    from mcore_rl.convert.verify import verify

    res = verify(a.hf, a.ckpt, a.tp, a.pp, a.prompt, ep=a.ep, n_random=a.tokens)
    print(res.line(a.tol, a.tp, a.pp) + (f" ep={a.ep}" if a.ep > 1 else ""))
    return 0 if res.max_abs_diff <= a.tol else 1


def _lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", required=True, help="LoRA adapter folder (lora.json + adapters.safetensors)")
    p.add_argument("--out", required=True, help="folder to create")
    p.add_argument("--base", default=None, help="HF base model folder (default: the path lora.json names)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def _run_lora_to_peft(a: argparse.Namespace) -> int:
    from mcore_rl.convert.peft_export import export_peft

    print(f"wrote {export_peft(a.adapters, a.out, a.base, a.force)} (PEFT LoRA adapter)")
    return 0


def _run_lora_merge(a: argparse.Namespace) -> int:
    from mcore_rl.convert.peft_export import export_merged

    print(f"wrote {export_merged(a.adapters, a.out, a.base, a.force)} (HF model, adapters merged)")
    return 0


COMMANDS: dict[str, Command] = {
    "hf-to-mcore": Command("HF safetensors -> Megatron torch_dist checkpoint", _hf_to_mcore_args, _run_hf_to_mcore),
    "mcore-to-hf": Command("Megatron torch_dist checkpoint -> HF safetensors", _mcore_to_hf_args, _run_mcore_to_hf),
    "verify": Command("compare transformers and Megatron logits", _verify_args, _run_verify),
    "lora-to-peft": Command("LoRA adapter folder -> PEFT adapter folder", _lora_args, _run_lora_to_peft),
    "lora-merge": Command("LoRA adapter folder + HF base -> merged HF folder", _lora_args, _run_lora_merge),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcore-rl-convert", description=__doc__.splitlines()[0])
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--traceback", action="store_true", help="show full tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        cmd.add_args(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    a = build_parser().parse_args(argv)
    try:
        return COMMANDS[a.command].run(a)
    except (ConvertError, FileExistsError) as e:
        if a.traceback:
            if getattr(e, "detail", None):
                print(e.detail, file=sys.stderr)
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no output was published", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
