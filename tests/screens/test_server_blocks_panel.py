"""Screen 2 with --kv-events beside a served run: the server's prefix cache, drawn from its events
(a stand-in publisher, in this process, connecting as vLLM's does), in the charts' place."""

from __future__ import annotations

from dataclasses import replace

from conftest import PROBE, SETTINGS, screen_text, wait_for
from fakes import measured_events

from kvtui.app import make_app
from kvtui.engines.capabilities import SERVED
from kvtui.engines.protocol import RunFinished, RunStarted, ServerMetrics
from kvtui.testing import ScriptedEngine
from kvtui.widgets.chart import Chart
from kvtui.widgets.server_blocks import ServerBlocksPanel
from tests.kv_events_standin import StandIn, free_endpoint, removed, stored

PROMPT = b"It is a truth universally acknowledged, that a single"  # 53 bytes
HOSTILE = b"[bold]x[/] \x1b[2J[@click=app.quit]q"


def served_events(usage: float) -> list:
    """A served run of 4 tokens whose server says `usage` of its 40 blocks of 4 are in use."""
    poll = ServerMetrics(seconds=0.1, kv_usage=usage, kv_blocks=40, kv_block_tokens=4)
    events = []
    for event in measured_events(replace(SETTINGS, tokens=4)):
        if isinstance(event, RunStarted):
            event = replace(
                event,
                served_by="vLLM 0.32.0 at http://127.0.0.1:1",
                can=SERVED,
                prompt_text=PROMPT.decode(),
            )
        if isinstance(event, RunFinished):
            events.append(poll)
        events.append(event)
    return events


def served_app(endpoint: str, usage: float = 0.0):
    events = served_events(usage)
    return make_app(
        replace(SETTINGS, tokens=4),
        2,
        probe=PROBE,
        engine_factory=lambda s: ScriptedEngine(events, settings=s),
        kv_events=endpoint,
    )


async def test_the_servers_blocks_are_drawn_with_what_the_gauge_cannot_say():
    endpoint = free_endpoint()
    app = served_app(endpoint, usage=0.05)  # 2 of 40 blocks in use
    publisher = StandIn(endpoint)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            feed = app.get_screen("cache").server_blocks
            await wait_for(pilot, lambda: app.live.state == "done" and app.live.server)
            publisher.join(feed)
            # the prompt's first 12 bytes in 3 blocks of 4, a branch off its first block, and a
            # block of hostile text, its second evicted: 5 held, 1 shared by two sequences
            publisher.send(1, [stored([1, 2, 3], list(PROMPT[:12]))])
            publisher.send(2, [stored([4], list(b"xyzw"), parent=1)])
            publisher.send(3, [stored([5, 6], list(HOSTILE[:8]))])
            publisher.send(4, [removed([6])])
            await wait_for(pilot, lambda: feed.view().removed == 1)
            app.screen.redraw_now()
            await pilot.pause(0.4)  # the panel follows its feed 4 times a second
            shown = screen_text(app)
            panel = app.screen.query_one(ServerBlocksPanel)
            assert panel.display and not any(c.display for c in app.screen.query(Chart))
            assert "5 blocks held · stored 6 · evicted 1 · 3 sequences, 1" in shown
            assert '■□ 000004 1 shared + "xyzw"' in shown
            assert '■□□ 000003 1 shared + "s a trut"' in shown
            assert '□ 000005 "[bol"' in shown and "\x1b" not in shown  # as written
            assert "3 cached blocks no request holds: free in vLLM's gauge" in shown
            assert "12 of 53 tokens in held blocks" in shown
            assert app.is_running
    finally:
        publisher.close()


async def test_a_silent_endpoint_is_said_and_the_app_stays_up():
    endpoint = free_endpoint()
    app = served_app(endpoint)
    async with app.run_test(size=(80, 24)) as pilot:
        feed = app.get_screen("cache").server_blocks
        await wait_for(pilot, lambda: app.live.state == "done")
        await wait_for(pilot, lambda: feed.view().waiting, timeout=15)
        await pilot.pause(0.4)
        assert "No events yet" in screen_text(app)
        assert app.is_running
