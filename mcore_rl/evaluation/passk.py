"""pass@k and mean@n from n samples per prompt: the unbiased estimator of Chen et al. (2021, Codex).

Why not "any of the n samples correct": that is pass@n only, and it is biased upward as an estimate of pass@k for
k < n. With c correct out of n, the probability that a random k-subset holds at least one correct sample is
1 - C(n-c, k) / C(n, k); we evaluate it as a running product so large n never overflows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with `c` correct among `n` samples (1 <= k <= n)."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def summarize_correct(correct: Sequence[Sequence[bool]] | np.ndarray, ks: Sequence[int] | None = None) -> dict[str, float]:
    """`correct[p][j]`: sample j of prompt p was right. Returns mean@n and pass@k (averaged over prompts) for
    every k in `ks` (default 1..n). All prompts must have the same n."""
    arr = np.asarray(correct, dtype=bool)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"summarize_correct needs a non-empty [prompts, n] matrix; got shape {arr.shape}")
    n = arr.shape[1]
    ks = list(range(1, n + 1)) if ks is None else [int(k) for k in ks]
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= n={n}; got k={bad}")
    counts = arr.sum(axis=1)
    out = {"n": float(n), "num_prompts": float(arr.shape[0]), "mean_at_n": float(arr.mean())}
    for k in ks:
        out[f"pass_at_{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
    return out
