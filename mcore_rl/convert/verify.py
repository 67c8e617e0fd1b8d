"""Logits equality: transformers on the HF folder vs Megatron on the converted checkpoint, same tokens.

Both run in fp32 on the same weights (for a bf16 checkpoint the HF weights are first rounded to bf16), so the
difference measures the conversion, not precision. The HF model is freed before Megatron is built: one model in memory at a time.
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.convert.common import HF_SUBDIR, ConvertError, ckpt_hf_config, read_ckpt_meta
from mcore_rl.convert.dist_reader import DistCheckpointReader
from mcore_rl.convert.launch import run_ranks
from mcore_rl.models.base import family_for

DEFAULT_PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Let's think step by step."
)


@dataclass
class VerifyJob:
    ckpt: str
    hf_config: dict
    tp: int
    pp: int
    tokens: torch.Tensor
    result: str
    ep: int = 1


@dataclass
class VerifyResult:
    max_abs_diff: float
    ref_abs_max: float
    argmax_agree: float
    n_tokens: int
    prompt_source: str  # "tokenizer" | "random"

    def line(self, tol: float, tp: int, pp: int) -> str:
        verdict = "OK" if self.max_abs_diff <= tol else "FAIL"
        return (f"max_abs_logit_diff={self.max_abs_diff:.3e} tol={tol:g} tokens={self.n_tokens} "
                f"({self.prompt_source}) tp={tp} pp={pp} argmax_agree={self.argmax_agree:.3f} "
                f"logit_absmax={self.ref_abs_max:.2f} {verdict}")


def prompt_tokens(hf_dir: Path, vocab_size: int, prompt: str | None = None,
                  n_random: int | None = None) -> tuple[torch.Tensor, str]:
    """[1, n] token ids: the prompt through the model's tokenizer when it has one, else seeded random ids
    (`n_random` of them when given: long prompts check positions beyond a scaled RoPE's original context)."""
    if n_random is not None:
        if n_random < 1:
            raise ConvertError(f"--tokens={n_random} must be >= 1")
        return torch.randint(0, vocab_size, (1, n_random), generator=torch.Generator().manual_seed(0)), "random"
    has_tokenizer = any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    if has_tokenizer:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(hf_dir)(prompt or DEFAULT_PROMPT)["input_ids"]
        if max(ids) >= vocab_size:
            raise ConvertError(f"tokenizer of {hf_dir} produced id {max(ids)} >= vocab_size {vocab_size}")
        return torch.tensor([ids], dtype=torch.long), "tokenizer"
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, 48), generator=g), "random"


@torch.no_grad()
def hf_logits(hf_dir: Path, tokens: torch.Tensor, weight_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # eager attention is the same math as Megatron's local attention (sdpa alone differs from it by ~1e-4)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if weight_dtype != torch.float32:
        for p in model.parameters():
            p.data = p.data.to(weight_dtype).float()
    logits = model(tokens).logits.float()
    del model
    gc.collect()
    return logits


def _verify_rank(job: VerifyJob) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.checkpoint_io import load_dist_checkpoint
    from mcore_rl.convert.megatron_model import build_model, forward_logits
    from mcore_rl.distributed import init_distributed

    init_distributed(job.tp, job.pp, ep=job.ep)
    args = family_for(job.hf_config).args(job.hf_config)
    model = build_model(args, job.tp, job.pp, "fp32", job.ep)
    load_dist_checkpoint(job.ckpt, model)
    logits = forward_logits(model, job.tokens, args.vocab_size)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(logits, job.result)


def megatron_logits(ckpt: Path, hf_config: dict, tokens: torch.Tensor, tp: int, pp: int,
                    ep: int = 1) -> torch.Tensor:
    with tempfile.TemporaryDirectory(prefix="mcore-rl-verify-") as tmp:
        result = Path(tmp) / "logits.pt"
        run_ranks(_verify_rank, VerifyJob(str(ckpt), hf_config, tp, pp, tokens, str(result), ep), tp * pp * ep)
        return torch.load(result, weights_only=True)


def verify(hf_dir: str | Path, ckpt: str | Path, tp: int = 1, pp: int = 1, prompt: str | None = None,
           ep: int = 1, n_random: int | None = None) -> VerifyResult:
    from mcore_rl.convert.hf_to_mcore import load_hf_model_info
    from mcore_rl.models.moe_spec import validate_moe_parallel
    from mcore_rl.models.spec import validate_parallel

    hf_dir, ckpt = Path(hf_dir).absolute(), Path(ckpt).absolute()
    read_ckpt_meta(ckpt)  # complete?
    _, _, args = load_hf_model_info(hf_dir)
    if args.num_labels:
        raise ConvertError(f"verify compares a causal LM's vocabulary logits; {hf_dir} is a reward model "
                           f"({args.architecture}) with no vocabulary logits")
    cfg = ckpt_hf_config(ckpt, None) if (ckpt / HF_SUBDIR).is_dir() else None
    try:
        validate_parallel(args, tp, pp)
        validate_moe_parallel(args, tp, ep)
    except ValueError as e:
        raise ConvertError(str(e)) from e
    tokens, source = prompt_tokens(hf_dir, args.vocab_size, prompt, n_random)
    ckpt_dtype = DistCheckpointReader(ckpt).dtypes.get("embedding.word_embeddings.weight", torch.float32)
    ref = hf_logits(hf_dir, tokens, ckpt_dtype)
    got = megatron_logits(ckpt, cfg or args.hf_config, tokens, tp, pp, ep)
    if got.shape != ref.shape:
        raise ConvertError(f"logits shape differs: transformers {tuple(ref.shape)}, Megatron {tuple(got.shape)}")
    return VerifyResult(
        max_abs_diff=(got - ref).abs().max().item(),
        ref_abs_max=ref.abs().max().item(),
        argmax_agree=(got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        n_tokens=tokens.numel(),
        prompt_source=source,
    )
