"""bench.soak.vllm_chaos's plan, without engines (the run itself takes minutes of two vLLM engines and
is outside CI): the fault schedule replays from its seed, and every later turn of a conversation
extends that same user's previous turn, so engine A (sets in order) and B (reversed) send the same
prompts as the baseline."""

from __future__ import annotations

from bench.soak.vllm_chaos import FAULT_KINDS, SYSTEM, conversation_batches, fault_schedule


def test_the_fault_schedule_is_a_function_of_the_seed_and_covers_every_kind() -> None:
    a, b = fault_schedule(7, 300.0), fault_schedule(7, 300.0)
    assert a == b and a != fault_schedule(8, 300.0)
    assert {kind for _, kind, _ in a} == set(FAULT_KINDS)
    assert all(25.0 <= at < 280.0 for at, _, _ in a) and [f[0] for f in a] == sorted(f[0] for f in a)


def test_later_turns_extend_the_same_users_previous_turn_in_either_order() -> None:
    users, turns = 3, 4
    forward, backward = conversation_batches([0, 1], users, turns), conversation_batches([1, 0], users, turns)
    assert len(forward) == 2 * turns and all(len(b) == users for b in forward)
    for batches in (forward, backward):
        for i, batch in enumerate(batches):
            for u, req in enumerate(batch):
                if i % turns == 0:
                    assert req["prompt_token_ids"][: len(SYSTEM)] == SYSTEM  # the shared prefix
                else:
                    assert req["extend"] == [i - 1, u]
    # set 1's first turn is the same prompt whichever engine runs it
    assert forward[turns] == backward[0] and forward[0] == backward[turns]
