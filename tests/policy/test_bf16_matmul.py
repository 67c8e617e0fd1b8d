"""bf16 matrix products through fp32 GEMMs (compat/bf16_matmul.py), for CPUs without bf16 matrix hardware.

What must hold for the route to stand in for a bf16 GEMM: each product is the fp32 product of the same bf16
operands rounded to bf16 once (bitwise), as close to the correctly rounded float64 product as torch's own bf16
kernel is, gradients flow through it, any other dtype runs torch's own kernel untouched, and `disable` restores
torch's kernels. The trainer decides per machine (`model.bf16_matmul`), logs the choice, and trains through it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from mcore_rl.compat import bf16_matmul
from mcore_rl.policy import precision

BF = torch.bfloat16


@pytest.fixture
def route():
    bf16_matmul.enable()
    yield
    bf16_matmul.disable()


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(96, 576, generator=g), torch.randn(576, 320, generator=g)
    bias = torch.randn(320, generator=g)
    qa, qb = torch.randn(3, 40, 64, generator=g), torch.randn(3, 64, 50, generator=g)
    return a.to(BF), b.to(BF), bias.to(BF), qa.to(BF), qb.to(BF), torch.randn(3, 40, 50, generator=g).to(BF)


def _products(a, b, bias, qa, qb, qbias):
    return {"mm": torch.mm(a, b), "addmm": torch.addmm(bias, a, b, beta=0.5, alpha=2.0), "bmm": torch.bmm(qa, qb),
            "baddbmm": torch.baddbmm(qbias, qa, qb, beta=0.0, alpha=0.125), "linear3d": F.linear(
                a.view(4, 24, 576), b.t(), bias)}  # fmt: skip


def test_each_product_is_the_fp32_product_rounded_once(route):
    ops = _operands()
    got = _products(*ops)
    wide = [t.float() for t in ops]
    bf16_matmul.disable()
    want = {k: v.to(BF) for k, v in _products(*wide).items()}  # fp32 kernels on the widened operands
    for name in want:
        assert got[name].dtype == BF and torch.equal(got[name], want[name]), name


def test_as_close_to_the_exact_product_as_torchs_own_bf16_kernel():
    """Against float64 rounded to bf16: the route must agree on at least as many entries as torch's native
    bf16 kernel does on this CPU (both ~99.99%; a wrong accumulation dtype would drop this to a fraction)."""
    a, b = _operands()[:2]
    exact = torch.mm(a.double(), b.double()).to(BF)
    native = torch.mm(a, b)
    bf16_matmul.enable()
    try:
        routed = torch.mm(a, b)
    finally:
        bf16_matmul.disable()
    agree_native = (native == exact).float().mean().item()
    agree_routed = (routed == exact).float().mean().item()
    one_ulp = (exact.float().abs() * 2.0**-7).clamp_min(1e-30)
    assert agree_routed >= min(agree_native, 0.999), (agree_routed, agree_native)
    assert ((routed.float() - exact.float()).abs() <= one_ulp).all()


def test_gradients_flow_and_other_dtypes_keep_torchs_kernels(route):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 64, generator=g).to(BF).requires_grad_()
    w = torch.randn(32, 64, generator=g).to(BF).requires_grad_()
    F.linear(x, w).float().square().sum().backward()
    assert x.grad.dtype == BF and w.grad.dtype == BF
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    F.linear(x32, w32).square().sum().backward()
    assert torch.allclose(w.grad.float(), w32.grad, rtol=3e-2, atol=0.5)  # bf16 output rounding, 8 bits
    a, b = torch.randn(33, 17, generator=g), torch.randn(17, 5, generator=g)
    routed = (torch.mm(a, b), torch.mm(a.double(), b.double()), torch.addmm(b[0], a, b))
    bf16_matmul.disable()
    assert torch.equal(routed[0], torch.mm(a, b)) and torch.equal(routed[1], torch.mm(a.double(), b.double()))
    assert torch.equal(routed[2], torch.addmm(b[0], a, b))
    with pytest.raises(RuntimeError):  # mixed dtypes fail as they do in torch's kernel
        bf16_matmul.enable()
        torch.mm(a, b.to(BF))


def test_disable_restores_torchs_kernel():
    a, b = _operands()[:2]
    native = torch.mm(a, b)
    bf16_matmul.enable()
    assert bf16_matmul.enabled()
    bf16_matmul.disable()
    assert not bf16_matmul.enabled() and torch.equal(torch.mm(a, b), native)


def test_configure_decides_per_machine_and_mode(monkeypatch):
    monkeypatch.setattr(precision, "_RATES", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        for rates, mode, dtypes, want in (
            ((251.0, 55.0), "auto", {"bf16"}, True),  # AVX-512 without AVX512-BF16 (measured here)
            ((109.0, 1.0), "auto", {"fp32", "bfloat16"}, True),  # AVX2-only, the engine in bf16
            ((188.0, 410.0), "auto", {"bf16"}, False),  # AMX / AVX512-BF16
            ((251.0, 55.0), "native", {"bf16"}, False),
            ((188.0, 410.0), "fp32", {"bf16"}, True),
            ((251.0, 55.0), "auto", {"fp32", "float32"}, False),  # no bf16 model: nothing to route
        ):
            monkeypatch.setattr(precision, "measure_matmul_rates", lambda r=rates: precision.MatmulRates(*r))
            assert precision.configure_bf16_matmul(mode, dtypes) is want, (rates, mode, dtypes)
            assert bf16_matmul.enabled() is want
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert precision.configure_bf16_matmul("fp32", {"bf16"}) is False  # CUDA has bf16 hardware
        with pytest.raises(ValueError, match=r"model.bf16_matmul='fast'"):
            precision.configure_bf16_matmul("fast", {"bf16"})
    finally:
        bf16_matmul.disable()


def test_a_bad_mode_is_one_config_error():
    from mcore_rl.config import ConfigError, load_config
    from tests.config.keyscan import compose

    with pytest.raises(ConfigError, match=r"model.bf16_matmul.*'fast'"):
        load_config(compose(["model=tiny", "model.bf16_matmul=fast"]))


@pytest.mark.e2e
def test_cli_trains_bf16_through_either_route(tmp_path):
    """The trainer CLI in bf16 with each route forced, on the tiny model's task where rewards vary: the choice
    is logged, both take real gradient steps, and step 1 (same seed, same prompts) sees the same rewards and
    gradient norm up to bf16 rounding."""
    from tests.conftest import run_train_batch
    from tests.e2e.sevens import TINY_TASK, assert_trains

    base = [*TINY_TASK, "model.dtype=bf16", "model.compile=false", "eval.num_prompts=0",
            "trainer.prompts_per_update=4", "trainer.samples_per_prompt=4", "trainer.max_new_tokens=4",
            "logging.progress=false", "trainer.export_hf=false", "logging.plot=false", "trainer.steps=2"]  # fmt: skip
    modes = ("fp32", "native")
    results = run_train_batch([[*base, f"model.bf16_matmul={m}", f"run.dir={tmp_path / m}"] for m in modes],
                              tmp_path)
    recs = {}
    for mode, proc in zip(modes, results):
        assert proc.returncode == 0, proc.stderr[-3000:]
        recs[mode] = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs[mode]] == [1, 2] and all(r["update_ok"] == 1.0 for r in recs[mode])
        assert_trains(recs[mode])  # rewards vary in the groups: real gradient steps
    assert "bf16 matmuls: bf16 operands, fp32 GEMM, result rounded to bf16 (model.bf16_matmul=fp32" in results[0].stderr
    assert "bf16 matmuls: torch's native kernels (model.bf16_matmul=native)" in results[1].stderr
    for one, two in zip(recs["fp32"], recs["native"]):
        print(f"\nstep {one['step']}, fp32 GEMM route vs native bf16: grad norm {one['grad_norm']:.5f} vs "
              f"{two['grad_norm']:.5f}, reward {one['reward_mean']:.3f} vs {two['reward_mean']:.3f}")
    one, two = recs["fp32"][0], recs["native"][0]
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=0.05)
    assert one["reward_mean"] == two["reward_mean"]
