"""The header line takes the device's few words from the probe's `label`, not from its prose."""

from __future__ import annotations

from textual.app import App, ComposeResult

from kvtui.gpu.probe import NullProbe
from kvtui.widgets.header import RunHeader

# A description whose prose does not split where the label ends.
DESCRIPTION = "NVIDIA H100 80GB HBM3: MIG 1g.10gb · 9.8 GiB"
LABEL = "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
NO_GPU = "CPU, no GPU: NVML library not found (libnvidia-ml.so.1)"


class HeaderApp(App):
    def compose(self) -> ComposeResult:
        yield RunHeader()


async def _shown(
    width: int, device: str, engine: str, model: str, status: str, **names: str
) -> str:
    """The header's line at `width` columns, showing a running run."""
    app = HeaderApp()
    async with app.run_test(size=(width, 3)) as pilot:
        header = app.query_one(RunHeader)
        header.show(device, engine, model, "running", status, **names)
        await pilot.pause()
        return str(header.render())


async def _shown_sim(width: int, device_label: str) -> str:
    return await _shown(
        width, DESCRIPTION, "sim:llama-3.1-8b@h100", "bf16", "step 3/32", device_label=device_label
    )


async def test_narrow_header_shows_the_label():
    # 86 columns (84 inside the padding) hold the label's 82, not the description's 89.
    line = await _shown_sim(86, device_label=LABEL)
    assert line == f"▶ step 3/32  │  sim:llama-3.1-8b@h100 (bf16)  │  {LABEL}"


async def test_wide_header_shows_the_description_in_full():
    assert (await _shown_sim(160, device_label=LABEL)).endswith(DESCRIPTION)


def test_the_null_probe_label_is_what_the_prose_used_to_be_cut_to():
    probe = NullProbe("NVML library not found (libnvidia-ml.so.1)")
    assert probe.label() == "CPU, no GPU"
    assert probe.describe().startswith(probe.label() + ": ")


async def test_a_header_too_narrow_for_the_device_leaves_it_out_rather_than_cut_it():
    """At 80 columns a running sim: run's status and engine leave no room for the device: the
    line ends with the engine, not with the device cut mid-word ("CPU, no")."""
    line = await _shown(
        80,
        NO_GPU,
        "sim:llama-3.1-70b@4xh100",
        "bf16",
        "running · uncached 202, cached 225 of 256",
        device_label="CPU, no GPU",
    )
    assert line == "▶ running · uncached 202, cached 225 of 256  │  sim:llama-3.1-70b@4xh100"


async def test_a_status_too_long_for_the_line_is_said_in_fewer_words_not_cut():
    """At 80 columns a stopped cached loop's status ("... cached loop stopped: KV cache full")
    does not fit beside the engine: the line says "KV cache full" whole, not "... KV cache"."""
    line = await _shown(
        80,
        NO_GPU,
        "tiny",
        "tiny-austen, cpu, fp32, 1 thread",
        "running · uncached 297, cached 293 of 600 · cached loop stopped: KV cache full",
        device_label="CPU, no GPU",
        status_short="running · uncached 297, cached 293 of 600 · KV cache full",
    )
    assert line == "▶ running · uncached 297, cached 293 of 600 · KV cache full  │  tiny"


async def test_at_80_columns_a_full_cache_in_lesson_mode_keeps_the_engine_and_the_state():
    """A lesson run whose cached loop fills its pool (2 MiB: 16 of llama's 128 KiB rows): its
    status ("done · uncached 24, cached 16 of 24 · KV cache full · lesson mode · r restarts")
    left no room at 80 columns, and the engine and device were cut off; the status now says
    less (the state, the full cache, lesson mode), the engine and device stay. Narrower, the
    device goes first, then the engine's end, never the state."""
    from kvtui.testing import RunSettings, headless

    settings = RunSettings(
        "sim:llama-3.1-8b@h100", tokens=24, lesson=True, kv_budget_bytes=2 * 1024 * 1024
    )
    async with headless(settings, 2, size=(80, 24)) as run:
        assert await run.until_done() == "done"
        header = run.text().splitlines()[0].strip()
        assert header == "✓ done · KV cache full · lesson  │  sim:llama-3.1-8b@h100  │  CPU, no GPU"
        shown = run.app.screen.query_one(RunHeader)
        shown.styles.width = 40
        await run.pilot.pause()
        # the fewest words, the state first: only the engine's end is cut (drawn with an ellipsis)
        assert str(shown.render()) == "✓ done · KV cache full · lesson │ sim:llama-3.1-8b@h100"
