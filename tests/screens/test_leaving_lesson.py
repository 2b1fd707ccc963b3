"""`l` and `r` always run something: leaving lesson mode after a lesson as long as the model's
positions caps the length to what the model holds past the full prompt, and says so."""

from kvtui.engines.factory import fit_tokens, prompt_positions
from kvtui.engines.protocol import RunSettings
from kvtui.testing import headless

# Llama 2 7B has 4,096 positions: a 4,095-token lesson (a one-token prompt) fits; the full
# 44-byte prompt leaves 4,052.
LONG_LESSON = RunSettings(engine="sim:llama-2-7b@h100", lesson=True, tokens=4095, replay_speed=0)


def test_fit_tokens_caps_to_the_models_positions_and_says_so():
    off = RunSettings(engine="sim:llama-2-7b@h100", lesson=False, tokens=4095)
    prompt = prompt_positions(off)
    fitted, said = fit_tokens(off)
    assert fitted.tokens == 4096 - prompt == 4052
    assert said.startswith("4,095 tokens capped to 4,052: ")
    assert said.endswith(" holds 4,096 positions, 44 of them the prompt")
    assert fit_tokens(LONG_LESSON) == (LONG_LESSON, "")  # it fits: unchanged, nothing said


async def test_l_out_of_a_long_lesson_and_r_after_it_run_the_longest_that_fits():
    async with headless(LONG_LESSON, screen=1, size=(80, 24)) as run:
        await run.until_done(timeout=60)
        await run.press("l")  # lesson mode off: the 44-byte prompt
        await run.wait_for(lambda: not run.app.live.settings.lesson)
        settings = run.app.live.settings
        assert settings.tokens == 4052 and run.app.length == 4052
        assert any("capped to 4,052" in n for n in run.notifications)
        assert await run.until_done(timeout=60) == "done"  # it ran: no "past its positions"
        await run.press("r")
        await run.wait_for(lambda: run.state == "running" or run.state == "done")
        assert run.app.live.settings.tokens == 4052
        assert await run.until_done(timeout=60) == "done"
