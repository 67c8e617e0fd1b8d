"""Make a reward model from a policy folder in about a minute: sample answers, label them, fit a linear score head
on the model's own last hidden state, save an HF `LlamaForSequenceClassification` folder.

Why: `reward=rm` needs a reward model, and a real one (trained on preference data) is a separate project. This
probe is the smallest honest stand-in: its score is a learned function of the (prompt, response) pair that the
policy can move by changing what it writes, so an RL run on it shows whether reward-model rewards reach the
policy (docs/rewards.md). Labels here are "the answer is right" (the a+b task's reference is the last number);
`--label short` prefers answers of at most `--short_chars` characters instead.

    python examples/reward_model/fit_probe_rm.py --base SMOLLM2_FOLDER --out /tmp/probe_rm

The pair is rendered as `reward=rm` renders it (the RM's chat template over a user turn and an assistant turn, no
generation prompt) and the hidden state is the final norm's output at the last token: the token HF's
`LlamaForSequenceClassification` scores. The head has no bias (HF's score layer has none).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mcore_rl.data.generators import ArithmeticConfig, make_arithmetic


def sample(
    model, tok, questions: list[str], n: int, max_new_tokens: int, temperature: float
) -> list[tuple[int, str]]:
    """(question index, response) pairs, n per question, sampled as the trainer's engine samples."""
    out: list[tuple[int, str]] = []
    tok.padding_side = "left"
    for start in range(0, len(questions), 16):
        chunk = questions[start : start + 16]
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in chunk
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(
                **enc,
                do_sample=True,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                pad_token_id=tok.pad_token_id,
            )
        for j, row in enumerate(gen[:, enc["input_ids"].shape[1] :]):
            out.append((start + j // n, tok.decode(row, skip_special_tokens=True)))
    return out


def features(model, tok, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """[N, hidden]: the final norm's output at the last token of each rendered (prompt, response)."""
    rows = []
    for q, r in pairs:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": r}],
            tokenize=False,
            add_generation_prompt=False,
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state  # LlamaModel output: after the final norm
        rows.append(hidden[0, -1].float())
    return torch.stack(rows)


def fit(x: torch.Tensor, y: torch.Tensor, l2: float, steps: int = 300) -> torch.Tensor:
    """Logistic regression without a bias (L-BFGS): w such that sigmoid(x @ w) ~ y."""
    w = torch.zeros(x.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=0.5, max_iter=steps)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y) + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def auc(scores: torch.Tensor, y: torch.Tensor) -> float:
    pos, neg = scores[y > 0.5], scores[y <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    return float(
        (pos[:, None] > neg[None, :]).float().mean() + 0.5 * (pos[:, None] == neg[None, :]).float().mean()
    )


def save_rm(base: Path, out: Path, w: torch.Tensor, scale: float) -> None:
    """`base`'s weights plus `score.weight = scale * w` as an HF LlamaForSequenceClassification folder."""
    from transformers import LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(base)
    rm = LlamaForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    rm.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        rm.score.weight.copy_((scale * w).unsqueeze(0))
    if out.exists():
        shutil.rmtree(out)
    rm.save_pretrained(out)
    tok.save_pretrained(out)


def last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d+", text)
    return nums[-1] if nums else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="HF folder of the policy (e.g. SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True)
    p.add_argument("--label", choices=["correct", "short"], default="correct")
    p.add_argument("--short_chars", type=int, default=12)
    p.add_argument("--questions", type=int, default=96)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--l2", type=float, default=1e-3)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the fitted head (the reward's unit)")
    p.add_argument(
        "--seed", type=int, default=1234, help="data seed: different from the training data's seed 0"
    )
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.base)
    model = AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32).eval()
    records, _ = make_arithmetic(ArithmeticConfig(size=a.questions, seed=a.seed))
    questions = [r.prompt[-1]["content"] for r in records]
    samples = sample(model, tok, questions, a.samples, a.max_new_tokens, a.temperature)
    if a.label == "correct":
        y = torch.tensor([float(last_number(r) == records[i].answer) for i, r in samples])
    else:
        y = torch.tensor([float(len(r.strip()) <= a.short_chars) for _, r in samples])
    x = features(model, tok, [(questions[i], r) for i, r in samples])
    n_fit = int(0.75 * len(y))
    w = fit(x[:n_fit], y[:n_fit], a.l2)
    fit_auc, held_auc = auc(x[:n_fit] @ w, y[:n_fit]), auc(x[n_fit:] @ w, y[n_fit:])
    w = fit(x, y, a.l2)  # the saved head uses every sample
    save_rm(Path(a.base), Path(a.out), w, a.scale)
    summary = {
        "label": a.label,
        "samples": len(y),
        "positive_rate": float(y.mean()),
        "fit_auc": fit_auc,
        "heldout_auc": held_auc,
        "seconds": round(time.perf_counter() - t0, 1),
        "out": a.out,
    }
    (Path(a.out) / "probe_fit.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
