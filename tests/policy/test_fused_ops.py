"""The compiled element-wise ops of the bf16 path (compat/fused_ops.py, policy/logprobs.py) against fp32 eager.

Each compiled op is fed bf16 inputs; its output and input gradients are compared with the same maths in fp32 on
the same (bf16-exact) values. The compiled op rounds once, where eager bf16 rounds after every op, so its error
must not exceed eager bf16's (x1.25 + 1 bf16 ulp of slack); the log-probs, computed in fp32 from bf16 logits, must
equal the fp32 reference to 1e-4. fp32 calls never reach these functions (the exactness tests stay eager).
Each test also checks which path ran: with a C++ toolchain (what inductor compiles with) every op must have run
compiled and none fallen back to eager; without one every op must have fallen back, and said so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_rl.compat import fused_ops
from mcore_rl.policy.logprobs import reference_logprobs, vocab_parallel_logprobs

BF16_ULP = 2.0**-8


def _toolchain() -> str | None:
    """The C++ compiler inductor would use, if it is installed (CXX, else g++ / clang++ on PATH)."""
    import shutil

    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return shutil.which(get_cpp_compiler())
    except Exception:  # noqa: BLE001 - no compiler found: inductor raises, the compiled ops fall back
        return None


@pytest.fixture
def ran_compiled():
    """Yield, then assert that each named op ran compiled (toolchain present) or fell back visibly (absent)."""
    before = fused_ops.compiled_calls()
    names: list[str] = []
    yield names
    after, fell_back = fused_ops.compiled_calls(), fused_ops.fallbacks()
    ran = {n: after.get(n, 0) - before.get(n, 0) for n in names}
    if _toolchain():
        assert not {n: fell_back[n] for n in names if n in fell_back}, "compile expected, fell back to eager"
        assert all(c > 0 for c in ran.values()), f"compile expected, compiled calls: {ran}"
    else:
        assert all(n in fell_back and ran[n] == 0 for n in names), (fell_back, ran)


def _leaf(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16).requires_grad_()


def _run(fn, *xs, grad_seed=99):
    out = fn(*xs)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    grads = torch.autograd.grad(out, [x for x in xs if x.requires_grad], gy)
    return out.float(), [g.float() for g in grads]


def _compare(compiled, eager_fn, *xs):
    ref_out, ref_g = _run(eager_fn, *[x.detach().float().requires_grad_(x.requires_grad) for x in xs])
    eag_out, eag_g = _run(eager_fn, *xs)
    com_out, com_g = _run(compiled, *xs)
    for c, e, r in zip([com_out, *com_g], [eag_out, *eag_g], [ref_out, *ref_g]):
        scale = r.abs().max().item()
        err_c, err_e = (c - r).abs().max().item(), (e - r).abs().max().item()
        assert err_c <= 1.25 * err_e + BF16_ULP * scale, (err_c, err_e, scale)
        assert err_c <= 4 * BF16_ULP * scale  # at most a few bf16 roundings of the largest value


def _eager_rms(x, w):
    return fused_ops._rms_norm(x, w, 1e-5) if x.dtype == torch.float32 else torch.nn.functional.rms_norm(
        x, (x.shape[-1],), w, 1e-5)


def test_compiled_rms_norm_swiglu_rope_match_fp32(ran_compiled):
    ran_compiled += ["_rms_norm", "_swiglu", "_rope"]
    x, w = _leaf((7, 3, 64), 0), _leaf((64,), 1, 0.5)
    _compare(lambda a, b: fused_ops.rms_norm(a, b, 1e-5), _eager_rms, x, w)
    h = _leaf((5, 2, 96), 2, 2.0)

    def eager_swiglu(t):
        a, b = torch.chunk(t, 2, -1)
        return F.silu(a) * b

    _compare(fused_ops.swiglu, eager_swiglu, h)
    t = _leaf((6, 2, 3, 16), 3)
    ang = torch.rand(6, 1, 1, 16, generator=torch.Generator().manual_seed(4)) * 6
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    _compare(lambda a: fused_ops.rope(a, cos, sin), lambda a: fused_ops._rope(a, cos.to(a.dtype), sin.to(a.dtype)), t)


@pytest.mark.parametrize("temperature,with_entropy,pad", [(1.0, True, 0), (0.7, False, 5)])
def test_compiled_logprobs_equal_fp32_reference(temperature, with_entropy, pad, monkeypatch, ran_compiled):
    """bf16 logits -> fp32 log-probs / entropy / gradients, compiled vs the eager path, and padded vocab rows."""
    ran_compiled.append("_logprobs_one_rank")
    V = 300
    logits = _leaf((2, 9, V + pad), 5, 4.0)
    targets = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(6))
    lp, ent = vocab_parallel_logprobs(logits, targets, V, temperature, with_entropy)
    ref = reference_logprobs(logits.detach().float()[..., :V], targets, temperature)
    assert lp.dtype == torch.float32 and (lp - ref).abs().max() < 1e-4
    g = torch.autograd.grad(lp.sum() + (ent.sum() if ent is not None else 0), logits)[0]
    monkeypatch.setattr(fused_ops, "_ENABLED", False)  # model.compile=false: the eager path on the same logits
    lp_e, ent_e = vocab_parallel_logprobs(logits, targets, V, temperature, with_entropy)
    g_e = torch.autograd.grad(lp_e.sum() + (ent_e.sum() if ent_e is not None else 0), logits)[0]
    assert (lp - lp_e).abs().max() < 1e-4
    if with_entropy:
        assert ent_e is not None and (ent - ent_e).abs().max() < 1e-4 and ent.min() > 0
    assert (g.float() - g_e.float()).abs().max() <= BF16_ULP * g_e.float().abs().max()
    if pad:
        assert g[..., V:].abs().max() == 0  # padded vocab rows get no gradient


def test_a_failed_compile_is_recorded_and_runs_eager(monkeypatch):
    """What the fixture relies on: a compile error leaves the op eager, counted in fallbacks(), not compiled_calls."""
    monkeypatch.setattr(fused_ops, "_BROKEN", {})

    def _boom(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: _boom)
    double = fused_ops._compiled(lambda x: 2 * x)
    assert double(torch.tensor(3.0)).item() == 6.0 and double(torch.tensor(4.0)).item() == 8.0
    assert fused_ops.fallbacks() == {"<lambda>": "RuntimeError: no C++ compiler"}
    assert "<lambda>" not in fused_ops.compiled_calls()


def test_fused_cpu_adam_switch_gives_the_same_update():
    """`use_fused_cpu_adam` flips torch AdamW under a Megatron-style wrapper to fused=True; same update to ~ulp."""
    from types import SimpleNamespace

    from mcore_rl.policy.build import use_fused_cpu_adam

    g = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1000, 37)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ref = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.01)
    ours = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=torch.optim.AdamW(b, lr=1e-2,
                                                                                          weight_decay=0.01))])
    assert use_fused_cpu_adam(ours) == 1 and use_fused_cpu_adam(ours) == 0  # idempotent
    for step in range(3):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        ref.step()
        ours.chained_optimizers[0].optimizer.step()
    diff = max((p - q).abs().max().item() for p, q in zip(a, b))
    moved = max((p - p0).abs().max().item() for p, p0 in zip(a, [torch.randn(n, generator=torch.Generator()
                                                                             .manual_seed(0)) for n in (1000,)]))
    assert diff < 1e-6 and moved > 1e-3


def test_varying_shapes_and_grad_modes_stay_within_the_recompile_limit(ran_compiled):
    """A training run calls RoPE with every micro-batch's length, batch sizes down to 1, with and without grad
    (old log-probs, training). Compiled as static first, each new combination recompiled until dynamo's limit (8),
    after which it silently ran eager. Compiled dynamic from the start: one graph per grad mode and batch-1 case."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    ran_compiled.append("rope_copy")

    def rope_copy(t, cos, sin):  # its own code object, so its cache entries count only this test's calls
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((-x2, x1), dim=-1) * sin

    op = fused_ops._compiled(rope_copy)
    heads, dim = 3, 16
    for s, b, grad in [(70, 4, False), (83, 4, False), (70, 4, True), (91, 2, True), (60, 8, False), (120, 1, True),
                       (100, 3, False), (55, 5, True), (77, 1, False), (99, 2, True), (33, 3, True), (41, 6, False)]:
        qkv = torch.randn(s, b, 3 * heads * dim).to(torch.bfloat16).requires_grad_(grad)
        q = qkv.view(s, b, 3 * heads, dim)[:, :, :heads]  # a strided view, as Megatron's query
        cos = sin = torch.randn(s, 1, 1, dim).to(torch.bfloat16)
        with torch.set_grad_enabled(grad):
            y = op(q, cos, sin)
            if grad:
                y.float().sum().backward()
    if fused_ops.fallbacks().get("rope_copy") is None:
        assert len(_debug_get_cache_entry_list(rope_copy.__code__)) <= 4
