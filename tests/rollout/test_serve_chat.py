"""`/v1/chat/completions` on `mcore-rl-serve` (what an LLM judge calls), over real HTTP with SmolLM2-135M-Instruct.

Checked: the prompt is the model's chat template with the generation prompt; the returned tokens and log-probs are
the engine's (the same request on /generate gives the same ones) and equal an HF forward under the engine's
convention, log_softmax(logits / T); `top_logprobs` are the k largest of that same distribution, sorted, with the
sampled token first when greedy; malformed requests are SGLang's one-line 400 ErrorResponse; every field accepted
or returned is one of sglang 0.5.23's (AST of its protocol.py).
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher
from tests.rollout.test_serve_classify import call

pytestmark = pytest.mark.rollout
MESSAGES = [{"role": "system", "content": "You are a strict grader."},
            {"role": "user", "content": [{"type": "text", "text": "Is 2 + 3 = 5?"},
                                         {"type": "text", "text": "Answer yes or no."}]}]  # fmt: skip
FLAT = [MESSAGES[0], {"role": "user", "content": "Is 2 + 3 = 5? Answer yes or no."}]


@pytest.fixture(scope="module")
def chat_url(smollm2_dir, tmp_path_factory):
    cfg = LauncherConfig(
        model_path=str(smollm2_dir), server="mcore-rl-serve", extra_args=["--num-threads", "1"], monitor=False,
        log_dir=str(tmp_path_factory.mktemp("chat_logs")), health_timeout_s=180,
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        yield launcher.worker_urls[0]


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def hf_logp(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """[len(output), V] log_softmax(logits / T) at each output position (T = 1 when greedy)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)[len(prompt) - 1 : -1]


def chat(url: str, **fields):
    return call(url, "/v1/chat/completions", {"model": "judge", "messages": MESSAGES, **fields}, key=None)


def same_on_generate(url: str, prompt: list[int], sp: dict) -> list[dict]:
    status, out = call(url, "/generate", {"input_ids": [prompt], "sampling_params": [sp], "return_logprob": True},
                       key=None)  # fmt: skip
    assert status == 200, out
    return out


def test_greedy_chat_is_the_engines_answer_with_hf_logprobs(chat_url, hf):
    model, tok = hf
    status, out = chat(chat_url, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5, rid="judge-1")
    assert status == 200, out
    assert set(out) == {"id", "object", "created", "model", "choices", "usage", "metadata"}
    assert out["object"] == "chat.completion" and out["model"] == "judge" and out["id"] == "judge-1"
    (choice,) = out["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "matched_stop"}
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    prompt = tok.apply_chat_template(FLAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt[-4:] == tok.encode(
        "<|im_start|>assistant\n", add_special_tokens=False
    )  # the generation prompt is there
    (ref,) = same_on_generate(chat_url, prompt, {"max_new_tokens": 8, "temperature": 0})
    ids = ref["output_ids"]
    content = choice["logprobs"]["content"]
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == len(ids) == len(content)
    assert usage["total_tokens"] == len(prompt) + len(ids)
    assert choice["message"]["content"] == ref["text"] and ref["text"]
    assert [e["logprob"] for e in content] == [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    assert b"".join(bytes(e["bytes"]) for e in content).decode().startswith(ref["text"])
    want = hf_logp(model, prompt, ids, 0.0)
    got = torch.tensor([e["logprob"] for e in content])
    assert torch.allclose(got, want.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4)
    top_want = want.topk(5, dim=-1)
    for i, e in enumerate(content):
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert torch.allclose(torch.tensor(tops), top_want.values[i], atol=1e-4)
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]  # greedy: the sampled token is the top one
        assert e["top_logprobs"][0]["token"] == e["token"] == tok.decode([ids[i]])


def test_sampled_chat_n2_seeded_top_logprobs_of_the_tempered_distribution(chat_url, hf):
    model, tok = hf
    fields = dict(
        max_completion_tokens=6, temperature=0.7, top_p=0.9, n=2, seed=11, logprobs=True, top_logprobs=3
    )
    status, out = chat(chat_url, **fields)
    assert status == 200, out
    prompt = tok.apply_chat_template(FLAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    refs = same_on_generate(chat_url, prompt, {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "n": 2,
                                               "sampling_seed": 11})  # fmt: skip
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == sum(len(r["output_ids"]) for r in refs)
    for choice, ref in zip(out["choices"], refs):
        content, ids = choice["logprobs"]["content"], ref["output_ids"]
        assert [e["logprob"] for e in content] == [
            lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]
        ]
        want = hf_logp(model, prompt, ids, 0.7)
        assert torch.allclose(torch.tensor([e["logprob"] for e in content]),
                              want.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4)  # fmt: skip
        for i, e in enumerate(content):
            tops = torch.tensor([t["logprob"] for t in e["top_logprobs"]])
            assert len(tops) == 3 and torch.allclose(tops, want[i].topk(3).values, atol=1e-4)
            assert e["logprob"] <= tops[0] + 1e-6
    assert [c["logprobs"]["content"] for c in out["choices"]][0] != [c["logprobs"]["content"] for c in
                                                                      out["choices"]][1]  # fmt: skip
    status, plain = chat(chat_url, max_tokens=2, temperature=0, stop=["\n"])
    assert status == 200 and plain["choices"][0]["logprobs"] is None


BAD = [
    ({"messages": []}, "Messages cannot be empty."),
    ({"model": "x"}, "Messages cannot be empty."),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role='wizard'"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "only text parts",
    ),  # fmt: skip
    ({"messages": FLAT, "stream": True}, "stream=true is not supported"),
    ({"messages": FLAT, "frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
    ({"messages": FLAT, "min_p": 0.1}, "min_p=0.1 is not supported"),
    ({"messages": FLAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools="),
    ({"messages": FLAT, "top_logprobs": -1}, "top_logprobs=-1 must be in"),
    ({"messages": FLAT, "max_tokens": 10**6}, "max_completion_tokens is too large: 1000000."),
    (
        {"messages": FLAT, "max_tokens": 8190},
        "Requested token count exceeds the model's maximum context length",
    ),
    ({"messages": FLAT, "temperature": "hot"}, "field 'temperature' must be number"),
    ({"messages": FLAT, "n": 0}, "SamplingParams.n=0"),
    ({"messages": FLAT, "top_p": 0}, "SamplingParams.top_p=0.0"),
    (
        {"messages": FLAT, "chat_template_kwargs": {"chat_template": "{{ x }}"}},
        "Request-supplied chat_template",
    ),
    (b"{oops", "not valid JSON"),
]


def test_malformed_chat_requests_are_one_line_400s(chat_url):
    for body, words in BAD:
        status, out = call(chat_url, "/v1/chat/completions", body, key=None)
        assert status == 400, (body, status, out)
        assert out["object"] == "error" and out["code"] == 400 and out["type"] == "BadRequest"
        assert words in out["message"] and "\n" not in out["message"], (body, out["message"])
    # a top_k beyond int64 (and the vocabulary) is the untruncated distribution, not a 500, on both routes
    assert chat(chat_url, max_tokens=1, top_k=2**70)[0] == 200
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "top_k": 2**70}}
    assert call(chat_url, "/generate", body, key=None)[0] == 200


def test_chat_fields_are_sglangs(tmp_path):
    from mcore_rl.rollout.server import chat
    from mcore_rl.rollout.server.app import build_app
    from tests.rollout.test_sglang_contract import CACHE, HTTP_SERVER, VERSION, _tree, routes, struct_fields

    found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if not found:
        pytest.skip(f"sglang {VERSION} wheel not in {CACHE}")
    import zipfile

    with zipfile.ZipFile(found[-1]) as wheel:
        structs = struct_fields(_tree(wheel, "sglang/srt/entrypoints/openai/protocol.py"))
        table = routes(_tree(wheel, HTTP_SERVER))
    assert "POST" in table[chat.ENDPOINT][0]
    request_fields = structs["ChatCompletionRequest"]
    assert {"messages", "logprobs", "top_logprobs", "bootstrap_host"} <= request_fields  # bases were read too
    accepted = {*chat.CHAT_TYPES, *chat.CHAT_NEUTRAL}
    assert accepted <= request_fields, sorted(accepted - request_fields)
    sample = {"index": 0, "message": {}, "logprobs": {}, "finish_reason": "stop", "matched_stop": None}
    shapes = {  # struct -> the keys this server writes
        "ChatCompletionResponse": {"id", "object", "created", "model", "choices", "usage", "metadata"},
        "ChatCompletionResponseChoice": set(sample),
        "ChatMessage": {"role", "content", "reasoning_content"},
        "ChoiceLogprobs": {"content"},
        "ChatCompletionTokenLogprob": {"token", "bytes", "logprob", "top_logprobs"},
        "TopLogprob": {"token", "bytes", "logprob"},
        "UsageInfo": {
            "prompt_tokens",
            "total_tokens",
            "completion_tokens",
            "prompt_tokens_details",
            "reasoning_tokens",
            "completion_tokens_details",
        },  # fmt: skip
        "ErrorResponse": {"object", "message", "type", "param", "code"},
    }
    for struct, keys in shapes.items():
        assert keys <= structs[struct], (struct, sorted(keys - structs[struct]))
    app = build_app(None, {"model_path": str(tmp_path)}, close_engine=False)
    assert ("POST", chat.ENDPOINT) in {(r.method, r.resource.canonical) for r in app.router.routes()}


def test_sample_next_top_is_sample_next_plus_sorted_topk():
    from mcore_rl.rollout.local.token_sampler import RowParams, sample_next, sample_next_top

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    temps = [0.0, 0.7, 1.0, 1.3]

    def params():
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        return RowParams.build(temps, [1.0, 0.9, 1.0, 1.0], [-1, -1, 5, -1], gens)

    tokens, lps = sample_next(logits.clone(), params())
    t2, lp2, vals, ids = sample_next_top(logits.clone(), params(), 6)
    assert torch.equal(tokens, t2) and torch.equal(lps, lp2)
    ref = torch.log_softmax(logits / torch.tensor([1.0, 0.7, 1.0, 1.3])[:, None], dim=-1)
    assert torch.allclose(vals, ref.topk(6).values) and torch.equal(ids, ref.topk(6).indices)
    assert torch.equal(t2[0], ids[0, 0])  # the greedy row's token is its top-1


@pytest.mark.slow
def test_chat_through_sglang_router(smollm2_dir, tmp_path):
    """sglang-router 0.3.2 forwards /v1/chat/completions to a worker: the routed answer (greedy) is the workers'."""
    cfg = LauncherConfig(
        model_path=str(smollm2_dir), server="mcore-rl-serve", num_servers=2, router=True, monitor=False,
        extra_args=["--num-threads", "1"], log_dir=str(tmp_path), health_timeout_s=180,
    )  # fmt: skip
    fields = dict(max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    with ServerLauncher(cfg) as launcher:
        routed = chat(launcher.router_url, **fields)
        direct = [chat(url, **fields) for url in launcher.worker_urls]
    assert routed[0] == 200 and all(code == 200 for code, _ in direct), (routed, direct)
    assert routed[1]["model"] == "judge" and len(routed[1]["choices"][0]["logprobs"]["content"]) >= 1
    assert all(routed[1]["choices"] == out["choices"] for _, out in direct)


def test_fuzzed_chat_bodies_never_500(chat_url):
    """Random JSON under ChatCompletionRequest's field names (one token, n <= 2 so it stays cheap): only 200, 400
    or 429 come back and the server stays healthy."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from mcore_rl.rollout.server.chat import CHAT_NEUTRAL, CHAT_TYPES
    from tests.rollout.test_server_fuzz import json_values, small_ints

    names = sorted(
        {*CHAT_TYPES, *CHAT_NEUTRAL, "zzz"} - {"max_tokens", "max_completion_tokens", "n", "stream"}
    )
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]) | json_values,
                                     "content": st.text(max_size=20) | json_values})  # fmt: skip
    value = json_values | small_ints | st.lists(message, max_size=3)
    seen: set[int] = set()

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(fields=st.dictionaries(st.sampled_from(names), value, max_size=4), n=st.integers(1, 2))
    def one(fields, n):
        body = {"messages": FLAT, **fields, "max_tokens": 1, "n": n}
        status, _ = call(chat_url, "/v1/chat/completions", body, key=None)
        assert status in (200, 400, 429), (body, status)
        seen.add(status)

    one()
    assert {200, 400} <= seen, seen
    assert call(chat_url, "/health", method="GET", key=None)[0] == 200
