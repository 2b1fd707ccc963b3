"""The UI process never imports torch, even with a real engine process running beside it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from kvtui.app import make_app
    from kvtui.engines.protocol import RunSettings

    async def main():
        settings = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=8, replay_speed=0)
        app = make_app(settings, 2, probe={"description": "test"})
        async with app.run_test(size=(100, 30)) as pilot:
            await app.workers.wait_for_complete()
            await pilot.pause()
            state, steps = app.live.state, app.live.loop("cached").steps
        print(json.dumps({"torch": "torch" in sys.modules, "state": state, "steps": steps}))

    asyncio.run(main())
    """
)


def test_the_app_and_a_sim_run_do_not_import_torch():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"torch": False, "state": "done", "steps": 8}
