"""The embedded engine's fast paths: one prefill per distinct prompt, a KV cache that never reallocates while
decoding, the CPU-shaped LM head, and the roofline arithmetic benchmarks/rollout_engine.py reports against."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.rollout.local.decode_batch import DecodeBatch, distinct_prompts
from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.local.lm_head import LastLogits, head_logits
from mcore_rl.rollout.local.roofline import DecodeCost, decode_roofline
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams, sample_seed
from tests.rollout.conftest import forward_logprobs

pytestmark = pytest.mark.rollout

PROMPT = [5, 17, 33, 8, 90, 4, 61]


def test_n_samples_share_one_prefill_and_match_separate_requests(tiny_dir, tiny_model):
    """n=4 of one prompt: the prompt runs through the model once, and every sample's tokens and log-probs are
    those of the same sample generated alone (own request, own prefill)."""
    sp = dict(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    with LocalEngine(str(tiny_dir)) as eng:
        shared = eng.generate([GenerationRequest(PROMPT, SamplingParams(n=4, seed=11, **sp))])
        assert eng.stats.prefill_tokens == len(PROMPT)  # not 4 x 7
        alone = [
            eng.generate([GenerationRequest(PROMPT, SamplingParams(seed=sample_seed(11, j), **sp))])[0]
            for j in range(4)
        ]
        assert eng.stats.prefill_tokens == 5 * len(PROMPT)
    assert len({tuple(s.output_ids) for s in shared}) > 1  # the samples differ from each other
    for s, a in zip(shared, alone):
        assert s.output_ids == a.output_ids
        assert torch.allclose(torch.tensor(s.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5)
        ref = forward_logprobs(tiny_model, PROMPT, s.output_ids, 1.0)
        assert (torch.tensor(s.output_logprobs) - ref).abs().max().item() < 1e-4


def test_distinct_prompts_keeps_first_seen_order():
    unique, inverse = distinct_prompts([[1, 2], [3], [1, 2], [3], [4, 5, 6]])
    assert unique == [[1, 2], [3], [4, 5, 6]] and inverse == [0, 1, 0, 1, 2]


def test_decode_writes_in_place_into_reserved_buffers(tiny_model):
    """Prefill reserves room for the longest response: 20 decode steps reuse the same K/V and mask storage."""
    cfg = tiny_model.config
    batch = DecodeBatch(tiny_model, cfg.num_hidden_layers, 0, torch.device("cpu"))
    with torch.inference_mode():
        logits, part = batch.prefill([PROMPT, [7, 8, 9], PROMPT], reserve=20)
        assert part.computed_tokens == len(PROMPT) + 3 and logits.shape == (3, cfg.vocab_size)
        assert torch.equal(logits[0], logits[2])  # the shared prompt's row is a copy
        tokens = [logits.argmax(-1)]
        batch.add(["a", "b", "c"], part, tokens[0], reserve=20)
        layer = batch.cache.layers[0]
        ptrs = (layer._kbuf.data_ptr(), layer._vbuf.data_ptr(), batch._mask_buf.data_ptr())
        assert batch.cache.capacity >= len(PROMPT) + 20
        for _ in range(20):
            tokens.append(batch.decode().argmax(-1))
            batch.advance(tokens[-1])
        assert (layer._kbuf.data_ptr(), layer._vbuf.data_ptr(), batch._mask_buf.data_ptr()) == ptrs
        assert batch.cache.seq_length == len(PROMPT) + 20 and batch.mask.shape == (3, len(PROMPT) + 20)
        # greedy through the batch (left padding, shared prefill) = greedy by plain full forwards
        for row, prompt in ((1, [7, 8, 9]), (2, PROMPT)):
            ids = list(prompt)
            for _ in range(6):
                ids.append(int(tiny_model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert [int(t[row]) for t in tokens[:6]] == ids[len(prompt) :]


def test_decode_grows_past_a_small_reserve(tiny_model):
    """Reserve 2 columns, decode 12 steps: buffers grow by doubling and greedy stays a plain forward's greedy."""
    batch = DecodeBatch(tiny_model, tiny_model.config.num_hidden_layers, 0, torch.device("cpu"))
    with torch.inference_mode():
        logits, part = batch.prefill([PROMPT], reserve=2)
        tokens = [int(logits.argmax())]
        batch.add(["a"], part, logits.argmax(-1), reserve=2)
        assert batch.cache.capacity == len(PROMPT) + 2
        for _ in range(12):
            tokens.append(int(batch.decode().argmax()))
            batch.advance(torch.tensor([tokens[-1]]))
        assert batch.cache.capacity >= len(PROMPT) + 12 and batch._mask_buf.shape[1] >= len(PROMPT) + 13
        ids = list(PROMPT)
        for _ in range(13):
            ids.append(int(tiny_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(PROMPT) :]


def test_finished_rows_leave_by_tail_rows_moving_into_their_slots(tiny_model):
    """Five rows decode; rows 0 and 3 finish. The kept rows' K/V stay in place except the tail rows that fill the
    vacated slots (new order [4, 1, 2]: no other row moves), and every kept row goes on with exactly the logits
    it would have had without the drop (greedy through the batch = plain full forwards)."""
    prompts = [PROMPT, [7, 8, 9], [3, 1, 4, 1, 5], [9, 2], [6, 6, 6, 6]]
    batch = DecodeBatch(tiny_model, tiny_model.config.num_hidden_layers, 0, torch.device("cpu"))
    with torch.inference_mode():
        logits, part = batch.prefill(prompts, reserve=12)
        first = logits.argmax(-1)
        batch.add(list(range(5)), part, first, reserve=12)
        outs = {r: [int(first[r])] for r in range(5)}
        for _ in range(3):
            tok = batch.decode().argmax(-1)
            batch.advance(tok)
            for i, r in enumerate(batch.rows):
                outs[r].append(int(tok[i]))
        layer = batch.cache.layers[0]
        before = layer._kbuf[:, :, : layer._len].clone()
        storage = layer._kbuf.untyped_storage().data_ptr()
        batch.keep([1, 2, 4])
        assert layer._kbuf.untyped_storage().data_ptr() == storage  # moved within the buffer, not copied out
        assert batch.rows == [4, 1, 2] and batch.cache.layers[0]._kbuf.shape[0] == 3
        after = layer._kbuf[:, :, : layer._len]
        lead = before.shape[2] - after.shape[2]  # columns cropped on the left (padding no kept row needs)
        for new, old in enumerate([4, 1, 2]):
            assert torch.equal(after[new], before[old, :, lead:])
        for _ in range(4):
            tok = batch.decode().argmax(-1)
            batch.advance(tok)
            for i, r in enumerate(batch.rows):
                outs[r].append(int(tok[i]))
        for r in (1, 2, 4):
            ids = list(prompts[r])
            for _ in range(8):
                ids.append(int(tiny_model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert outs[r] == ids[len(prompts[r]) :]


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 64])
def test_cpu_lm_head_equals_the_plain_product(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(3000, 96, generator=gen)  # vocab not a multiple of the 1024 block
    hidden = torch.randn(rows, 96, generator=gen)
    got = head_logits(hidden, weight)
    want = torch.nn.functional.linear(hidden, weight)
    assert got.shape == (rows, 3000) and got.is_contiguous()
    assert (got - want).abs().max().item() < 1e-4


def test_last_logits_equal_the_models_own(tiny_model):
    last = LastLogits(tiny_model)
    assert last.head is tiny_model.lm_head  # llama: logits are exactly lm_head(hidden)
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.inference_mode():
        want = tiny_model(input_ids=ids).logits[:, -1]
        got = last(input_ids=ids)
    assert (got - want).abs().max().item() < 1e-5


def test_roofline_arithmetic(tiny_model):
    """DecodeCost of the rollout tiny Llama (2 layers, hidden 64, 4 heads / 2 KV heads of 16, MLP 128, vocab
    256, untied head) and the per-step max(compute, streaming) bound, checked against hand-computed numbers."""
    cost = DecodeCost.of(tiny_model)
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)  # q, k, v, o, gate/up/down
    assert cost.matmul_params == 2 * per_layer + 256 * 64
    assert (cost.layers, cost.q_heads, cost.kv_heads, cost.head_dim, cost.bytes_per_value) == (2, 4, 2, 16, 4)
    assert cost.flops(3, 10) == 3 * (2 * cost.matmul_params + 4 * 2 * 4 * 16 * 10)
    assert cost.bytes(3, 10) == (cost.matmul_params + 2 * 2 * 2 * 16 * 10 * 3) * 4
    roof = decode_roofline(cost, [(3, 10), (1, 11)], gflops=1e-3, gbs=1.0)
    c = [cost.flops(3, 10) / 1e6, cost.flops(1, 11) / 1e6]
    m = [cost.bytes(3, 10) / 1e9, cost.bytes(1, 11) / 1e9]
    assert roof.tokens == 4
    assert roof.compute_s == pytest.approx(sum(c)) and roof.memory_s == pytest.approx(sum(m))
    assert roof.bound_s == pytest.approx(max(c[0], m[0]) + max(c[1], m[1]))
    assert roof.tokens_per_s == pytest.approx(4 / roof.bound_s)


def test_one_matmul_probe_serves_auto_and_the_roofline(monkeypatch):
    """`model.dtype=auto`'s probe (policy/precision.matmul_gflops) and the engine roofline's square probe both time
    `torch.mm` through precision.time_matmul: with clocks that advance 0.25 s (wall) and 0.5 s (CPU) per
    reading, both report 2*m*k*n FLOP per 0.25 s wall / 0.5 s CPU, best of the calls."""
    from mcore_rl.policy import precision
    from mcore_rl.rollout.local import roofline

    ticks = {"wall": 0.0, "cpu": 0.0}

    def clock(name: str, step: float):
        def now() -> float:
            ticks[name] += step
            return ticks[name]

        return now

    monkeypatch.setattr(precision.time, "perf_counter", clock("wall", 0.25))
    monkeypatch.setattr(precision.time, "process_time", clock("cpu", 0.5))
    auto = precision.matmul_gflops(torch.float32, m=32, k=16, n=8, min_time=1.0)
    assert auto == pytest.approx(2 * 32 * 16 * 8 / 1e9 / 0.25)
    square = roofline.matmul_gflops(torch.device("cpu"), torch.float32, size=16, repeats=3)
    assert square.wall == pytest.approx(2 * 16**3 / 1e9 / 0.25)
    assert square.cpu == pytest.approx(2 * 16**3 / 1e9 / 0.5)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_cpu_lm_head_regroups_in_fp32_only(rows):
    """fp32: the grouped forms (torch.mm); bf16, where the plain product measured as fast or faster: F.linear."""
    from tests.rollout.test_engine_fused_forward import _Calls

    gen = torch.Generator().manual_seed(rows)
    weight, hidden = torch.randn(3000, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    for dtype, form in ((torch.float32, "mm"), (torch.bfloat16, "linear")):
        with _Calls() as calls:
            head_logits(hidden.to(dtype), weight.to(dtype))
        assert form in calls.names and ({"mm", "linear"} - {form}).isdisjoint(calls.names), (dtype, calls.names)
