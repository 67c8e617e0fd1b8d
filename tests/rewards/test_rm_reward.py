"""`reward=rm`: rendering with the RM's own chat template, normalisation, too_long, the trainer-scorer hand-off, and
the `/classify` client (ClassifyScorer) against a stand-in server on 127.0.0.1 (tests/rewards/stand_in.py): SGLang
0.5.23's request read from the wheel by AST, batching, round-robin, retries, timeouts, malformed answers and the
API key. The rows here use SmolLM2's tokenizer in a light folder (no weights: the scores come from the stand-in or
a fake scorer; `rm_dir` in tests/rewards/conftest.py); tests/rewards/test_rm_e2e.py scores with real weights."""

from __future__ import annotations

import json
import logging
import math

import pytest

from mcore_rl.config.checks import ConfigError
from mcore_rl.rewards import build_reward, check_reward, describe, step_metrics
from mcore_rl.rewards.reward_model import NORMALIZE_EPS, TRAINER_ONLY, Renderer
from tests.rewards.stand_in import StandIn
from tests.rollout import test_sglang_contract as contract

pytestmark = pytest.mark.rollout
wheel = contract.wheel  # the sglang 0.5.23 wheel (downloaded once into ~/.cache/mcore-rl), read by AST
SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok(rm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(rm_dir)


class FakeScorer:
    """A trainer-side TokenScorer: returns `values` in order (or len(row)), keeps the rows it was given."""

    def __init__(self, values: list[float] | None = None):
        self.values, self.calls, self.closed = list(values or []), [], False

    def score_ids(self, rows):
        self.calls.append(rows)
        return [self.values.pop(0) if self.values else float(len(r)) for r in rows]

    def close(self):
        self.closed = True


def _rm(path, scorer=None, **options):
    return build_reward(
        {"name": "rm", "rm": {"path": str(path), **options}}, scorers={"rm": scorer} if scorer else None
    )


def _recs(*prompts):
    return [{"prompt_id": pid, "prompt": p, "answer": "", "metadata": {}} for pid, p in prompts]


def test_chat_rows_are_the_rm_templates_tokens(rm_dir, tok):
    """The RM sees [prompt messages, assistant response] in its own ChatML template, no generation prompt after."""
    fake = FakeScorer()
    fn = _rm(rm_dir, fake)
    recs = _recs(
        ("a", "What is 3 + 4?"),
        ("b", [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]),
    )
    res = fn.score(["7", "4"], ["7", "4"], recs)
    rows = fake.calls[0]
    assert tok.decode(rows[0]) == (
        SMOL_SYSTEM + "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"
    )
    assert tok.decode(rows[1]) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )  # a chat prompt kept as its messages
    im_start, im_end, newline = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "Ċ"])
    assert rows[0][0] == im_start and rows[0][-2:] == [im_end, newline] and len(rows[0]) == 41
    assert [(r.score, r.correct, r.reason, r.metrics) for r in res] == [
        (41.0, False, "ok", {"rm_score": 41.0}),
        (float(len(rows[1])), False, "ok", {"rm_score": len(rows[1])}),
    ]
    text = _rm(rm_dir, FakeScorer(), template="text")
    text.score(["7"], [""], _recs(("a", "What is 3 + 4?")))
    assert text.scorer.calls[0] == [tok("What is 3 + 4?7")["input_ids"]]
    fn.close()
    assert fake.closed


def test_normalisation_by_hand(rm_dir):
    """Raw scores 1, 2, 3 (prompt a) and 5, 5 (prompt b). group: a -> (x - 2) / sqrt(2/3), b -> 0 (std 0: the
    epsilon keeps it finite); batch: mean 3.2, population std 1.6."""
    recs = _recs(("a", "q"), ("a", "q"), ("b", "r"), ("a", "q"), ("b", "r"))
    raw = [1.0, 2.0, 5.0, 3.0, 5.0]
    z = 1 / math.sqrt(2 / 3)
    want = {"none": raw, "group": [-z, 0.0, 0.0, z, 0.0], "batch": [-1.375, -0.75, 1.125, -0.125, 1.125]}
    for mode, expected in want.items():
        res = _rm(rm_dir, FakeScorer(list(raw)), normalize=mode).score(["x"] * 5, [""] * 5, recs)
        assert [r.score for r in res] == pytest.approx(expected, rel=1e-5, abs=1e-9), mode
        assert [r.metrics["rm_score"] for r in res] == raw  # the raw logit is what gets logged
    assert 0 < NORMALIZE_EPS <= 1e-6


def test_too_long_rows_are_not_scored_and_counted(rm_dir, tok, caplog):
    renderer = Renderer(str(rm_dir), "chat")
    short = len(renderer.render("q", "7"))
    fake = FakeScorer([1.0, 3.0])
    fn = _rm(rm_dir, fake, max_length=short, normalize="group")
    with caplog.at_level(logging.WARNING, logger="mcore_rl.rewards"):
        res = fn.score(["7", "7 7 7", "8", "a long answer"], [""] * 4, _recs(*[("a", "q")] * 4))
    m = step_metrics(fn, res)
    assert [len(r) for r in fake.calls[0]] == [short, short]  # only the two short rows were sent
    assert [r.reason for r in res] == ["ok", "too_long", "ok", "too_long"]
    assert [r.score for r in res] == pytest.approx(
        [-1.0, 0.0, 1.0, 0.0], rel=1e-5
    )  # stats over the scored two
    assert m["reward_rm_too_long"] == 2 and m["reward/rm_score"] == 2.0 and m["reward_rm_failures"] == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"rm reward: 2 of 4 samples longer than max_length={short} tokens scored 0 (too_long)"
    ]


def test_trainer_placement_needs_the_trainers_scorer(rm_dir):
    with pytest.raises(ValueError) as e:
        _rm(rm_dir)
    assert (
        str(e.value)
        == TRAINER_ONLY
        == (
            "reward.rm.placement=trainer is scored by the trainer's Megatron RM; "
            "outside mcore-rl-train use placement=server"
        )
    )
    with pytest.raises(
        ValueError, match=r"scorers given for \['rm2'\], which reward.name='rm' does not name"
    ):
        build_reward(
            {"name": "rm", "rm": {"path": str(rm_dir)}}, scorers={"rm": FakeScorer(), "rm2": FakeScorer()}
        )
    # a numbered part gets its own scorer, under its own name
    fn = build_reward(
        {"name": "rm+rm2", "rm": {"path": str(rm_dir)}, "rm2": {"path": str(rm_dir), "label": 1}},
        scorers={"rm": FakeScorer([1.0]), "rm2": FakeScorer([5.0])},
    )
    assert [r.score for r in fn.score(["7"], [""], _recs(("a", "q")))] == [6.0]


def _classify_rm(path, urls, **options):
    return build_reward(
        {
            "name": "rm",
            "rm": {"path": str(path), "placement": "server", "urls": urls, "backoff_s": 0.01, **options},
        }
    )


def test_classify_batches_round_robin_and_reads_the_label(rm_dir, tok):
    renderer = Renderer(str(rm_dir), "chat")
    answers = ["7", "8", "seven", "3 + 4 = 7", "no idea"]
    rows = [renderer.render("What is 3 + 4?", a) for a in answers]
    with StandIn() as one, StandIn() as two:
        fn = _classify_rm(rm_dir, [one.url, two.url + "/"], label=1, batch_size=2, max_concurrency=1)
        try:
            res = fn.score(answers, ["7"] * 5, _recs(*[("a", "What is 3 + 4?")] * 5))
            m = step_metrics(fn, res)
        finally:
            fn.close()
    assert [r.score for r in res] == [float(sum(r) % 97) for r in rows]  # embedding[1] of each row
    sent = one.bodies("/classify") + two.bodies("/classify")
    assert [set(b) for b in sent] == [{"input_ids"}] * 3
    assert [len(b["input_ids"]) for b in one.bodies("/classify")] == [2, 1]  # requests 0 and 2
    assert [b["input_ids"] for b in two.bodies("/classify")] == [rows[2:4]]  # request 1
    assert sorted(r for b in sent for r in b["input_ids"]) == sorted(rows)
    assert m["reward_rm_requests"] == 3 and m["reward_rm_retries"] == 0 and m["reward_remote_failures"] == 0
    assert one.max_in_flight == 1


def test_classify_retries_timeouts_malformed_and_the_key(rm_dir, tmp_path, caplog):
    """5xx then success (retried), a hang past the per-attempt timeout (retried, then counted), a malformed answer
    (not retried), all in one step; the rest is scored. One request in flight: the first to arrive (the 500) is the
    first row's. Then the API key: sent from a mode-600 file, never shown."""
    renderer = Renderer(str(rm_dir), "chat")
    answers = ["7", "HANG", "GARBAGE", "8"]
    rows = [renderer.render("q", a) for a in answers]
    with (
        StandIn(
            fail_first=1, hang_marker=json.dumps(rows[1]), garbage_marker=json.dumps(rows[2]), hang_s=1.5
        ) as srv,
        caplog.at_level(logging.WARNING, logger="mcore_rl.rewards"),
    ):
        fn = _classify_rm(rm_dir, [srv.url], batch_size=1, timeout_s=0.5, max_attempts=2, max_concurrency=1)
        try:
            res = fn.score(answers, [""] * 4, _recs(*[("a", "q")] * 4))
            m = step_metrics(fn, res)
        finally:
            fn.close()
    assert [r.reason for r in res] == ["ok", "remote_error:timeout", "remote_error:malformed", "ok"]
    assert [r.score for r in res] == [float(len(rows[0])), 0.0, 0.0, float(len(rows[3]))]
    sent = [b["input_ids"][0] for b in srv.bodies("/classify")]
    assert (
        sent.count(rows[0]) == 2 and sent.count(rows[1]) == 2 and sent.count(rows[2]) == 1 and len(sent) == 6
    )
    assert (
        m["reward_rm_requests"] == 4 and m["reward_rm_requests_failed"] == 2 and m["reward_rm_retries"] == 2
    )
    assert m["reward_rm_failures"] == 2 and m["reward_remote_failures"] == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "2 of 4 requests failed (malformed=1, timeout=1)" in lines[0], lines

    key_file = tmp_path / "rm.key"
    key_file.write_text("rm-s3cret\n")
    key_file.chmod(0o600)
    with StandIn(api_key="rm-s3cret") as srv:
        fn = _classify_rm(rm_dir, [srv.url], api_key_file=str(key_file))
        anon = _classify_rm(rm_dir, [srv.url])
        try:
            assert [r.reason for r in fn.score(["7"], [""], _recs(("a", "q")))] == ["ok"]
            assert [r.reason for r in anon.score(["7"], [""], _recs(("a", "q")))] == ["remote_error:http_401"]
            shown = describe(fn)
        finally:
            fn.close()
            anon.close()
    assert (
        srv.requests[0][2]["Authorization"] == "Bearer rm-s3cret" and len(srv.requests) == 2
    )  # 401: no retry
    assert "s3cret" not in shown and f"placement=server http://127.0.0.1:{srv.port}" in shown
    assert "api key: from api_key_file" in shown and "normalize=none" in shown


def test_classify_body_is_sglangs_embedding_request(wheel, rm_dir):
    """Every field the client sends is a field of 0.5.23's EmbeddingReqInput, with the batch form of its type."""
    tree = contract._tree(wheel, contract.IO_STRUCT)
    assert contract.routes(contract._tree(wheel, contract.HTTP_SERVER))["/classify"][0] >= {"POST"}
    cls = next(c for c in tree.body if getattr(c, "name", None) == "EmbeddingReqInput")
    annotations = {s.target.id: ast_unparse(s.annotation) for s in cls.body if hasattr(s, "annotation")}
    with StandIn() as srv:
        fn = _classify_rm(rm_dir, [srv.url])
        try:
            fn.score(["7", "8"], ["", ""], _recs(("a", "q"), ("a", "q")))
        finally:
            fn.close()
    (body,) = srv.bodies("/classify")
    assert set(body) <= set(annotations), sorted(set(body) - set(annotations))
    assert annotations["input_ids"] == "Optional[Union[List[List[int]], List[int]]]"
    assert isinstance(body["input_ids"], list) and all(
        isinstance(r, list) and all(type(t) is int for t in r) for r in body["input_ids"]
    )


def ast_unparse(node) -> str:
    import ast

    return ast.unparse(node)


@pytest.mark.parametrize(
    "rm, match",
    [
        ({}, r"reward.rm.path is not set"),
        (
            {"path": "/nonexistent"},
            r"reward.rm.path='/nonexistent': cannot read config.json \(FileNotFoundError\)",
        ),
        ({"placement": "cluster"}, r"reward.rm.placement='cluster': expected one of trainer, server"),
        ({"normalize": "zscore"}, r"reward.rm.normalize='zscore': expected one of none, group, batch"),
        ({"template": "jinja"}, r"reward.rm.template='jinja': expected one of chat, text"),
        ({"label": 2}, r"reward.rm.label=2: the model has 2 logit column\(s\)"),
        ({"max_length": 0}, r"reward.rm.max_length=0 must be > 0"),
        (
            {"placement": "server"},
            r"reward.rm.placement=server needs reward.rm.urls=\[http://host:port,...\] \(the RM servers",
        ),
        ({"placement": "server", "urls": ["ftp://b"]}, r"reward.rm: 'ftp://b' is not an http\(s\) URL"),
        ({"timeout_s": 0}, r"reward.rm.timeout_s=0 must be > 0"),
    ],
)
def test_bad_rm_settings_are_one_line_config_errors(rm_dir, rm, match):
    options = {"path": str(rm_dir), **rm} if "path" not in rm and rm != {} else rm
    with pytest.raises(ConfigError, match=match) as e:
        check_reward({"name": "rm", "rm": options})
    assert "\n" not in str(e.value)


def test_not_a_classifier_is_refused(smollm2_dir):
    with pytest.raises(
        ConfigError,
        match=r"config.json's architectures are \[\]; expected a \*ForSequenceClassification model",
    ):
        check_reward({"name": "rm", "rm": {"path": str(smollm2_dir)}})


def test_math_verify_plus_rm_with_weights_and_per_part_metrics(rm_dir):
    """`math_verify+rm`: the score is the weighted sum, `correct` comes from math_verify, and each part's own score is
    logged as `reward/<part>` (its mean over the step), next to the RM's raw `reward/rm_score`."""
    fake = FakeScorer([2.0, -1.0, 4.0])
    fn = build_reward(
        {
            "name": "math_verify+rm",
            "weights": {"math_verify": 1.0, "rm": 0.25},
            "max_crash_rate": 0.5,
            "rm": {"path": str(rm_dir)},
        },
        scorers={"rm": fake},
    )
    try:
        res = fn.score(
            ["3 + 4 = 7", "it is 8", "\\boxed{7}"], ["7"] * 3, _recs(*[("a", "What is 3 + 4?")] * 3)
        )
        m = step_metrics(fn, res)
    finally:
        fn.close()
    assert [r.score for r in res] == pytest.approx([1.5, -0.25, 2.0])
    assert [r.correct for r in res] == [True, False, True]
    assert res[1].reason == "math_verify=wrong_answer,rm=ok"
    assert m["reward/math_verify"] == pytest.approx(2 / 3) and m["reward/rm"] == pytest.approx(5 / 3)
    assert m["reward/rm_score"] == pytest.approx(5 / 3) and m["reward_rm_too_long"] == 0
    assert fake.closed
