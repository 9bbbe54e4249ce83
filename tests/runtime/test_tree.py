"""The agent tree at run time: streamed replies link sub-agents, queued tickets follow priority."""

from __future__ import annotations

from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.runtime.tree import AgentTree
from agentkv_bench.subagents import agent_call, scripted_reply


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def user(text: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}


def test_a_streamed_reply_that_ends_in_agent_calls_links_and_warms() -> None:
    clock = Clock()
    dispatcher = Dispatcher(RuntimeConfig(n_slots=1), clock=clock)
    tree = AgentTree(dispatcher=dispatcher, clock=clock)
    tree.place("s", None, 0, user("build it"))
    events = scripted_reply(
        [
            {"type": "text", "text": "Splitting."},
            agent_call("c1", "Write the tests", "test it", background=False),
            agent_call("c2", "Write the docs", "document it", background=True),
        ]
    )
    clock.now = 5.0
    tree.replied("s", events)
    # The coordinator waits for both (its turn ended in them): its slot is kept warm.
    assert tree.warm() == {"s"}
    fg = tree.place("s", "a1", 0, user("context\n\ntest it"))
    bg = tree.place("s", "a2", 0, user("context\n\ndocument it"))
    assert (fg.description, fg.priority, fg.waited_on) == ("Write the tests", 0, True)
    # Background, but the coordinator has said nothing since: still waited on, for now.
    assert (bg.description, bg.priority, bg.waited_on) == ("Write the docs", 0, True)
    clock.now = 6.0
    tree.place("s", None, 0, user("go on"))
    place = tree.describe("s/a2")
    assert place is not None and place.priority == 1 and not place.waited_on


def test_a_reply_without_agent_calls_changes_nothing() -> None:
    clock = Clock()
    dispatcher = Dispatcher(RuntimeConfig(n_slots=1), clock=clock)
    tree = AgentTree(dispatcher=dispatcher, clock=clock)
    tree.place("s", None, 1, user("hi"))
    tree.replied("s", scripted_reply([{"type": "text", "text": "hello"}]))
    assert tree.warm() == frozenset()


def test_queued_subagent_tickets_take_their_new_priority_keeping_their_arrival() -> None:
    """When the coordinator goes on, its background sub-agent's queued request drops a level."""
    clock = Clock()
    dispatcher = Dispatcher(RuntimeConfig(n_slots=1), clock=clock)
    tree = AgentTree(dispatcher=dispatcher, clock=clock)
    tree.place("s", None, 1, user("go"))
    tree.replied(
        "s",
        scripted_reply([agent_call("c1", "Docs", "document it", background=True)]),
    )
    busy = dispatcher.submit("other", 1, (1, 2, 3))  # takes the only slot
    place = tree.place("s", "a1", 1, user("document it"))
    assert place.priority == 1
    ticket = dispatcher.submit(place.agent, place.priority, (4, 5, 6))
    clock.now = 3.0
    tree.place("s", None, 1, user("go on"))
    (queued,) = dispatcher.snapshot().queue
    assert queued.ticket == ticket.id and queued.priority == 2
    assert queued.waited_s == 3.0  # the same arrival: aging counts from it
    assert busy.id != ticket.id


def test_with_the_tree_off_every_request_is_its_root() -> None:
    clock = Clock()
    dispatcher = Dispatcher(RuntimeConfig(n_slots=1), clock=clock)
    tree = AgentTree(dispatcher=dispatcher, clock=clock, enabled=False)
    place = tree.place("s", "a1", 2, user("x"))
    assert (place.agent, place.priority, place.parent) == ("s", 2, None)
    assert tree.warm() == frozenset()
    assert tree.view() == []
