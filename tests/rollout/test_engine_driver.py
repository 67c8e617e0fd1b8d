"""LocalEngine.wait: a caller waiting for its samples runs the decode steps on its own thread (one OpenMP team in
the process; the engine docstring has the measurement), the worker steps only while nobody waits, and the results
do not depend on which thread stepped: same seeds, same tokens and log-probs. Timeouts, pauses, concurrent callers
and close() keep their meaning."""

from __future__ import annotations

import threading
import time

import pytest

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams

pytestmark = pytest.mark.rollout
PROMPTS = [[5, 17, 33, 8], [7, 8, 9], [200, 3, 44, 12, 5]]


def _reqs(seed: int = 3, tokens: int = 12) -> list[GenerationRequest]:
    sp = dict(temperature=1.0, max_new_tokens=tokens, ignore_eos=True, n=2)
    return [GenerationRequest(p, SamplingParams(seed=seed + i, **sp)) for i, p in enumerate(PROMPTS)]


@pytest.fixture
def stepping_threads(monkeypatch) -> list[str]:
    """Names of the threads that ran each engine step."""
    names: list[str] = []
    step = LocalEngine._step

    def recorded(self, admit):
        names.append(threading.current_thread().name)
        return step(self, admit)

    monkeypatch.setattr(LocalEngine, "_step", recorded)
    return names


def _tokens(samples) -> list:
    return [(s.output_ids, s.output_logprobs) for s in samples]


def test_generate_steps_on_the_callers_thread_and_submit_alone_on_the_worker(tiny_dir, stepping_threads):
    with LocalEngine(str(tiny_dir)) as eng:
        driven = eng.generate(_reqs())
        on_caller = list(stepping_threads)
        stepping_threads.clear()
        futures = eng.submit(_reqs())  # nobody waits through the engine: the worker serves them
        deadline = time.monotonic() + 60
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            time.sleep(0.01)
        served = [f.result() for f in futures]
    assert on_caller and set(on_caller) == {threading.current_thread().name}
    assert stepping_threads and set(stepping_threads) == {"local-rollout-engine"}
    assert _tokens(driven) == _tokens(served)  # the stepping thread changes nothing in the samples


def test_wait_times_out_while_paused_and_finishes_after_resume(tiny_dir):
    with LocalEngine(str(tiny_dir)) as eng:
        eng.pause("in_place")
        futures = eng.submit(_reqs())
        t0 = time.monotonic()
        assert eng.wait(futures, timeout=0.3) is False
        assert 0.25 < time.monotonic() - t0 < 5.0 and not any(f.done() for f in futures)
        eng.resume()
        assert eng.wait(futures, timeout=60) is True
        assert all(len(f.result().output_ids) == 12 for f in futures)


def test_concurrent_callers_each_get_their_own_samples(tiny_dir, stepping_threads):
    """Two threads generating at once share the batch (whichever drives serves both) and each gets what it would
    have got alone."""
    with LocalEngine(str(tiny_dir)) as eng:
        alone = {seed: _tokens(eng.generate(_reqs(seed))) for seed in (3, 50)}
        stepping_threads.clear()
        got: dict[int, list] = {}
        callers = [threading.Thread(target=lambda s=s: got.__setitem__(s, _tokens(eng.generate(_reqs(s)))),
                                    name=f"caller-{s}") for s in (3, 50)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(timeout=120)
    for seed in (3, 50):  # batched with the other caller's rows: the GEMMs round differently, same tokens
        assert [ids for ids, _ in got[seed]] == [ids for ids, _ in alone[seed]]
        diff = max(abs(a - b) for (_, la), (_, lb) in zip(got[seed], alone[seed]) for a, b in zip(la, lb))
        assert diff < 1e-4, diff
    assert set(stepping_threads) <= {"caller-3", "caller-50", "local-rollout-engine"}


def test_abort_from_another_thread_ends_a_driven_wait(tiny_dir):
    """The waiting caller is idle (paused engine) when another thread aborts: it wakes, retires the aborted
    rows itself and returns."""
    with LocalEngine(str(tiny_dir)) as eng:
        eng.pause("in_place")
        futures = eng.submit(_reqs())
        threading.Timer(0.2, eng.abort).start()
        t0 = time.monotonic()
        assert eng.wait(futures, timeout=60) is True
        assert time.monotonic() - t0 < 10
        assert {f.result().finish_reason for f in futures} == {"abort"}


def test_close_releases_a_waiting_caller(tiny_dir):
    eng = LocalEngine(str(tiny_dir))
    eng.pause("in_place")
    futures = eng.submit(_reqs())
    closer = threading.Timer(0.2, eng.close)
    closer.start()
    t0 = time.monotonic()
    eng.wait(futures, timeout=30)  # returns at close, not at the timeout
    assert time.monotonic() - t0 < 10
    closer.join(timeout=60)
    assert all(f.done() and isinstance(f.exception(), RuntimeError) for f in futures)


def test_on_cuda_callers_wait_plainly_and_the_worker_steps_without_grace(tiny_dir, stepping_threads):
    """The OpenMP-team reason is a CPU one: with the engine's device reported as CUDA (the tiny model stays on
    the CPU, only the device checks read it), generate and wait leave every step to the worker."""
    import torch

    with LocalEngine(str(tiny_dir)) as eng:
        eng.device = torch.device("cuda")
        assert eng._grace_left() == 0.0
        driven = eng.generate(_reqs())
        futures = eng.submit(_reqs(seed=9))
        assert eng.wait(futures, timeout=60) is True
    assert stepping_threads and set(stepping_threads) == {"local-rollout-engine"}
    assert all(len(s.output_ids) == 12 for s in driven)
