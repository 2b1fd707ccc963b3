"""--kv-events against a real vLLM 0.32 server (FIRST: blocks of 32, prefix caching, its KV
cache events published to `vllm_server.events_endpoint`, where kvtui binds): the blocks drawn on
screen 2 are the ones the server stored for the run's prompt, and the hits they predict for a
repeat of it are the server's own."""

from __future__ import annotations

import random

import pytest

from kvtui.app import make_app
from kvtui.engines.protocol import RunSettings
from kvtui.testing import NO_GPU_PROBE, screen_text, wait_for

from .server import BLOCK_TOKENS, VLLMServer

pytestmark = pytest.mark.vllm


def prompt() -> str:
    """107 bytes (3 whole blocks of 32 and 11 more), new to the server: no block of it cached."""
    start = f"{random.randrange(10**8):08d} "
    text = start + "Elizabeth walked to the window and looked out on the lawn, where the rain had s"
    return (text + "topped an hour ago.")[:107]


async def run_again(pilot, app) -> None:
    """`r`, and until the new run has begun (its request asked for after the last one's): an
    8-token run may be done before a check of its state would see it running."""
    asked = app.live.since
    await pilot.press("r")
    await wait_for(pilot, lambda: app.live.since != asked, timeout=10)


async def test_the_blocks_drawn_are_the_servers_and_predict_its_hits(vllm_server: VLLMServer):
    assert vllm_server.events_endpoint, "FIRST publishes its events"
    # vLLM's publisher connects to kvtui's endpoint on its own schedule, and a subscription is
    # live only some time after: a run's batches may all come before it. A repeat of that
    # prompt stores nothing new (its blocks are cached), so a try that saw none is a new app
    # with a new prompt.
    for _ in range(3):
        if await one_try(vllm_server):
            return
    pytest.fail("in 3 tries, no run's blocks were seen stored")


async def one_try(vllm_server: VLLMServer) -> bool:
    """A new prompt's run: False where none of its blocks were seen stored, else the checks."""
    text = prompt()
    ids = list(text.encode())
    settings = RunSettings(
        engine=f"vllm:{vllm_server.url}", tokens=8, greedy=True, loops=("cached",), prompt=text
    )
    app = make_app(settings, 2, probe=NO_GPU_PROBE, kv_events=vllm_server.events_endpoint)
    async with app.run_test(size=(120, 40)) as pilot:
        feed = app.get_screen("cache").server_blocks
        assert feed is not None
        await wait_for(pilot, lambda: app.live.state == "done", timeout=60)
        try:
            await wait_for(pilot, lambda: feed.prefix_tokens(ids) == 3 * BLOCK_TOKENS, timeout=5)
        except AssertionError:
            return False  # its batches came before the subscription was live
        await drawn_and_hit(pilot, app, feed, text, ids)
        return True


async def drawn_and_hit(pilot, app, feed, text: str, ids: list[int]) -> None:
    """The blocks drawn are the prompt's, as the server stored them, and the server's hits on a
    repeat of the prompt are the ones they predict."""
    first = text[:32].encode()

    def ours() -> list:
        """The chains drawn whose first block is the prompt's, stored with no parent (the view
        is the feed's newest, made a few times a second: it may lag the fold a moment)."""
        view = feed.view()
        return [s for s in view.sequences if s.rooted and bytes(s.blocks[0].token_ids) == first]

    await wait_for(pilot, lambda: bool(ours()), timeout=5)
    chain = ours()[0].blocks
    assert b"".join(bytes(b.token_ids) for b in chain[:3]) == text[:96].encode()
    assert all(b.size == BLOCK_TOKENS for b in chain)
    assert len({b.key for b in chain}) == len(chain)  # a hash a block
    await pilot.pause(0.5)
    app.screen.redraw_now()
    await pilot.pause(0.3)
    assert "96 of 107 tokens in held blocks" in screen_text(app)

    await run_again(pilot, app)  # the same prompt again: the server hits the 3 blocks drawn
    await wait_for(pilot, lambda: app.live.state == "done", timeout=60)
    server = lambda: app.live_run.server  # noqa: E731
    await wait_for(pilot, lambda: (server().prefix_hits_seen or 0) >= 96, timeout=30)
    assert server().prefix_hits_seen == 3 * BLOCK_TOKENS == feed.prefix_tokens(ids)
    assert app.is_running
