"""Pipeline schedules as data: every built-in passes the checker, its simulated bubble equals the
closed form exactly on unit costs, 1F1B holds at most P micro-batches, broken schedules are
named."""

import dataclasses

import pytest

from plait.config.choices import PP_SCHEDULES
from plait.parallel.pipeline.schedules import (
    Action,
    Kind,
    ScheduleError,
    build_schedule,
)
from plait.parallel.pipeline.simulator import check, simulate, textbook_bubble

CASES = [(name, P, M) for name in PP_SCHEDULES for P in (2, 4) for M in (P, 2 * P, 4 * P)]


@pytest.mark.parametrize("name,P,M", CASES)
def test_builtin_schedules_pass_the_checker_with_the_textbook_bubble(name, P, M):
    schedule = build_schedule(name, P, M, chunks_per_stage=2)
    check(schedule)
    timeline = simulate(schedule)
    assert timeline.bubble == pytest.approx(textbook_bubble(schedule), abs=1e-12)
    # Every stage is busy for exactly its share of the work: M (F + B [+ W]) per chunk.
    per_chunk = 3 * M
    assert timeline.busy == [per_chunk * schedule.chunks_per_stage] * P


@pytest.mark.parametrize("P,M", [(2, 8), (4, 16), (8, 8)])
def test_activation_memory(P, M):
    assert simulate(build_schedule("gpipe", P, M)).peak_in_flight == [M] * P
    one_f_one_b = simulate(build_schedule("1f1b", P, M)).peak_in_flight
    assert one_f_one_b == [P - s for s in range(P)] and max(one_f_one_b) <= P
    assert max(simulate(build_schedule("zb1", P, M)).peak_in_flight) <= P  # 1F1B's peak


def test_interleaving_divides_the_bubble_by_v():
    plain = simulate(build_schedule("1f1b", 4, 8))
    inter = simulate(build_schedule("interleaved", 4, 8, chunks_per_stage=4))
    # Bubble time (P - 1)(F + B), in units of one full-model micro-batch, shrinks V-fold.
    assert (plain.makespan - 3 * 8) == 4 * (inter.makespan / 4 - 3 * 8)


def _broken(mutate):
    schedule = build_schedule("1f1b", 2, 4)
    actions = [list(seq) for seq in schedule.actions]
    mutate(actions)
    return dataclasses.replace(schedule, actions=actions)


def test_a_deadlocking_schedule_is_rejected_naming_the_first_stuck_action():
    def swap(actions):  # stage 0 does its first backward before the forward it depends on
        actions[0][0], actions[0][2] = actions[0][2], actions[0][0]

    with pytest.raises(ScheduleError, match=r"deadlock at stage 0, action 0: B\(mb=0, chunk=0\) "
                                            r"waits for F\(mb=0, chunk=0\)"):
        check(_broken(swap))


def test_messages_must_be_taken_in_the_order_they_are_sent():
    """Stage 1 takes micro-batch 1's activation before micro-batch 0's. No deadlock (sends are
    asynchronous), and gloo's tags would match it, but NCCL matches by order."""

    schedule = build_schedule("gpipe", 2, 4)  # stage 1: F0 F1 F2 F3 B0 B1 B2 B3
    actions = [list(seq) for seq in schedule.actions]
    actions[1][0], actions[1][1] = actions[1][1], actions[1][0]  # F1 before F0 on stage 1
    schedule = dataclasses.replace(schedule, actions=actions)
    with pytest.raises(ScheduleError, match=r"stage 1, action 0: F\(mb=1, chunk=1\) takes the "
                                            r"message of F\(mb=1, chunk=0\) from stage 0, "
                                            r"which sends that of F\(mb=0, chunk=0\) first"):
        check(schedule)


@pytest.mark.parametrize("mutate,message", [
    (lambda a: a[0].pop(), r"B\(mb=3, chunk=0\) is missing"),
    (lambda a: a[1].append(Action(Kind.F, 0, 0)), r"stage 1, action 8: F\(mb=0, chunk=0\) "
                                                   r"belongs to stage 0"),
    (lambda a: a[0].insert(1, a[0][0]), r"stage 0, action 1: F\(mb=0, chunk=0\) appears twice"),
    (lambda a: a[0].append(Action(Kind.W, 0, 0)), "W only exists when the backward is split"),
])
def test_malformed_schedules_are_rejected(mutate, message):
    with pytest.raises(ScheduleError, match=message):
        check(_broken(mutate))


def test_interleaved_needs_whole_groups():
    with pytest.raises(ScheduleError, match="divisible by stages"):
        build_schedule("interleaved", 4, 6, chunks_per_stage=2)


def test_layers_are_balanced_by_parameter_count_unless_listed():
    import torch

    from plait.model import build_model, model_args
    from plait.parallel.pipeline.stage import balanced_split, split_model

    assert balanced_split([10] * 8, 0, 0, 4) == [2, 2, 2, 2]
    # The embedding and the head weigh 2.5 layers each: the end chunks get fewer layers.
    assert balanced_split([10] * 8, 25, 25, 4) == [1, 3, 3, 1]
    model = build_model(model_args("tiny", n_layers=6), seed=0)
    chunks = split_model(model, 3, sizes=[1, 2, 3])
    assert [list(c.layers) for c in chunks] == [["0"], ["1", "2"], ["3", "4", "5"]]
    assert hasattr(chunks[0], "tok_embeddings") and hasattr(chunks[2], "output")
    # Names are the model's, and the chunks in a row compute the model.
    assert "layers.4.attention.wq.weight" in dict(chunks[2].named_parameters())
    tokens = torch.randint(0, 256, (2, 8))
    h = tokens
    for c in chunks:
        h = c(h)
    torch.testing.assert_close(h, model(tokens))
    with pytest.raises(ValueError, match="split"):
        split_model(model, 3, sizes=[2, 2, 1, 1])


def test_a_measured_step_replays_to_its_own_bubble():
    """`plait bench pp`'s replay: a step's measured spans, simulated again with each action's
    duration and free messages. Spans that are themselves a simulation (no message cost) replay
    to the same timeline; a last stage twice as dear (the head and the loss) widens the
    bubble beyond the formula's."""
    from plait.bench.pp import replayed, stage_costs

    def spans_of(timeline):
        return [[(a.kind.value, a.microbatch, a.chunk, start, end) for a, start, end in stage]
                for stage in timeline.spans]

    schedule = build_schedule("1f1b", 2, 4)
    ideal = simulate(schedule)
    again = replayed(schedule, spans_of(ideal))
    assert again.bubble == pytest.approx(ideal.bubble) and again.makespan == ideal.makespan
    units = {Kind.F: 1.0, Kind.B: 2.0}
    heavy = simulate(schedule, lambda stage, a: units[a.kind] * (2 if stage == 1 else 1))
    assert replayed(schedule, spans_of(heavy)).bubble > textbook_bubble(schedule) + 0.1
    assert stage_costs(spans_of(heavy)) == [{"F": 1.0, "B": 2.0}, {"F": 2.0, "B": 4.0}]
