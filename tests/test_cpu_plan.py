from __future__ import annotations

import pytest
import torch

from chatcli.engine.cpu_plan import SMALL_MODEL_PARAMS, ThreadChoice, apply_cpu_plan, plan_for


def test_a_small_model_decodes_on_one_thread_and_a_big_one_on_every_core(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    small = torch.nn.Linear(10, 10)
    assert plan_for(small).threads == 1
    monkeypatch.setattr("chatcli.engine.cpu_plan.SMALL_MODEL_PARAMS", 100)
    assert plan_for(small).threads == 3
    assert SMALL_MODEL_PARAMS > 4_000_000  # the embedded model is small


def test_apply_cpu_plan_sets_torchs_threads():
    before = torch.get_num_threads()
    try:
        plan = apply_cpu_plan(torch.nn.Linear(4, 4))
        assert plan is not None and torch.get_num_threads() == plan.threads == 1
    finally:
        torch.set_num_threads(before)


def _run(choice: ThreadChoice, seconds: dict[int, float], runs: int) -> list[int]:
    used = []
    for _ in range(runs):
        threads = choice.threads()
        used.append(threads)
        choice.record(seconds[threads])
    return used


def test_thread_choice_keeps_the_preferred_count_while_it_is_faster():
    choice = ThreadChoice(2, 1, first_probe=4, probe_every=10)
    used = _run(choice, {2: 0.030, 1: 0.040}, 30)
    # 4 runs, a probe of one thread, then 10 runs between probes.
    assert used[:6] == [2, 2, 2, 2, 1, 2]
    assert used.count(1) == 3 and choice.threads() == 2


def test_thread_choice_moves_to_the_other_count_when_it_measures_faster():
    choice = ThreadChoice(2, 1, first_probe=4, probe_every=10)
    used = _run(choice, {2: 0.120, 1: 0.045}, 30)
    assert used[:5] == [2, 2, 2, 2, 1]
    assert used[5:16] == [1] * 10 + [2]  # it stays, and probes two threads later
    assert choice.threads() == 1


def test_thread_choice_follows_a_change_of_load():
    choice = ThreadChoice(2, 1, first_probe=2, probe_every=5)
    _run(choice, {2: 0.030, 1: 0.040}, 10)
    assert choice.threads() == 2
    # Another process takes a core: two threads get slow; within one probe period it moves.
    used = _run(choice, {2: 0.120, 1: 0.045}, 12)
    assert used[-1] == 1 and choice.threads() == 1


def test_thread_choice_ignores_a_difference_inside_the_margin():
    choice = ThreadChoice(2, 1, first_probe=3, probe_every=4, margin=0.05)
    _run(choice, {2: 0.030, 1: 0.029}, 40)  # 3% faster: not worth a switch
    assert choice.current == 2


def test_thread_choice_between_equal_counts_never_probes():
    choice = ThreadChoice(1, 1, first_probe=1, probe_every=1)
    assert _run(choice, {1: 0.01}, 5) == [1] * 5


def test_thread_choice_refuses_empty_probes():
    with pytest.raises(ValueError, match="at least 1"):
        ThreadChoice(2, 1, probe_len=0)


def test_a_long_prefill_chunk_gets_every_core_and_a_short_one_the_callers(monkeypatch):
    from chatcli.engine.cpu_plan import WIDE_PREFILL_TOKENS, prefill_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert prefill_threads(WIDE_PREFILL_TOKENS) == 4
    assert prefill_threads(WIDE_PREFILL_TOKENS - 1) == 1  # a chat turn's chunk
    assert prefill_threads(1) == 1


@pytest.mark.parametrize(("setting", "cores"), [("2", 2), ("16", 4), ("", 4), ("many", 4)])
def test_omp_num_threads_caps_the_cores_a_plan_uses(monkeypatch, setting, cores):
    from chatcli.engine.cpu_plan import available_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", setting)
    assert available_cores() == cores
    monkeypatch.setattr("chatcli.engine.cpu_plan.SMALL_MODEL_PARAMS", 10)
    assert plan_for(torch.nn.Linear(10, 10)).threads == cores


def test_torch_threads_sets_the_count_inside_and_restores_it_after_an_error():
    from chatcli.engine.cpu_plan import torch_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with pytest.raises(RuntimeError), torch_threads(2):
            assert torch.get_num_threads() == 2
            raise RuntimeError("a failing prefill")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_thread_choice_is_not_moved_by_a_noisy_spell_of_the_faster_count():
    # Two threads take 1.0 at best, and half their runs are slowed to 3.0 by other work on
    # the host (median 2.0); one thread takes 1.5 every run. A lucky-looking probe of one
    # thread beats the median, but not the two threads' best runs: stay on two.
    choice = ThreadChoice(2, 1, first_probe=8, probe_every=8)
    noisy = iter([1.0, 3.0] * 100)
    used = []
    for _ in range(60):
        threads = choice.threads()
        used.append(threads)
        choice.record(next(noisy) if threads == 2 else 1.5)
    assert choice.current == 2
    assert used.count(1) == 60 // 9  # only the probes
