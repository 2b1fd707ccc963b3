"""Every label says how its figure was had, per engine: measured (tiny, shape:, hf: running
now), modelled (sim:), replayed (a record of a measured run, with where and when it was made);
the what-if follows the run (its split, its dtype); a probe that cannot read the GPU says so
in plain words. Driven headless through kvtui.testing, as a user sees the screens."""

from __future__ import annotations

from dataclasses import replace

from fakes import measured_events

from kvtui.engines.protocol import Event, RunStarted
from kvtui.engines.replay import read_record
from kvtui.gpu.probe import NullProbe
from kvtui.paths import asset_path
from kvtui.testing import HeadlessRun, RunSettings, headless

RECORD = asset_path("tiny-cpu.jsonl")
"""The shipped recording: kvtui bench --engine tiny --tokens 64, on this project's CPU."""
SIZE = (100, 30)


def as_live(events: list[Event], **started: object) -> list[Event]:
    """A recorded run's events as the engine sends them while it runs (no recording date)."""
    return [
        replace(e, recorded_at="", **started) if isinstance(e, RunStarted) else e for e in events
    ]


async def screens(run: HeadlessRun) -> dict[int, str]:
    """Screens 1, 2 and 3 as text, the run ended, each line's words joined by single spaces."""
    await run.until_done()
    shown = {}
    for screen in (1, 2, 3):
        await run.press(str(screen))
        await run.settle()
        shown[screen] = " ".join(run.text().split())
    return shown


async def test_a_live_tiny_run_says_measured_everywhere_and_nothing_cached_with_the_cache_off():
    _, events = read_record(RECORD)
    async with headless(RunSettings("tiny", tokens=64), engine=as_live(events), size=SIZE) as run:
        shown = await screens(run)
        await run.press("2", "c")
        await run.settle()
        cache_off = " ".join(run.text().split())
    header = shown[1][: shown[1].index("1 ·")]
    assert "tiny (tiny-austen, cpu, fp32, 1 thread)" in header
    assert "positions per step, measured" in shown[1]
    assert "measured time per step" in shown[1]
    assert "MEASURED" in shown[2] and "wall time" in shown[2] and "A cached step:" in shown[2]
    assert "LIVE (measured): tiny-austen on cpu" in shown[3]
    assert "fp32: fp16 weights; a CPU computes fp32" in shown[3]  # which dtype ran, and why
    assert "Formula bytes, FLOPs / measured time:" in shown[3]
    for text in shown.values():
        assert "placeholder" not in text and "replayed" not in text.lower()
        assert "MODELLED" not in text and "modelled time" not in text
    # The cache off: nothing of the cached loop, its times or its legend, is left on screen 2.
    assert "A cached step" not in cache_off and "with a cache" not in cache_off
    assert "without a cache x: tokens" in cache_off
    assert "c puts the cached loop beside it" in cache_off


async def test_a_shape_and_an_hf_run_say_measured_and_the_what_if_follows_the_shape():
    shape = RunSettings("shape:gpt2", tokens=16)
    events = as_live(measured_events(shape), model="shape:gpt2", dtype_source="the weights' own")
    async with headless(shape, 3, engine=events, size=SIZE) as run:
        await run.until_done()
        text = " ".join(run.text().split())
        assert "LIVE (measured): shape:gpt2 on cpu" in text
        assert "WHAT-IF (modelled): GPT-2" in text and run.app.screen.model == "gpt2"
    hf = RunSettings("hf:/models/Qwen2.5-0.5B", tokens=16)
    events = as_live(
        measured_events(hf),
        model="Qwen/Qwen2.5-0.5B",
        kv_capacity_bytes=None,  # transformers' own cache: no pool
        dtype="fp32",
        dtype_source="bf16 weights; a CPU computes fp32",
    )
    async with headless(hf, 3, engine=events, size=SIZE) as run:
        await run.until_done()
        text = " ".join(run.text().split())
    assert "LIVE (measured): Qwen/Qwen2.5-0.5B on cpu: no KV pool" in text
    assert "fp32: bf16 weights; a CPU computes fp32" in text


async def test_a_sim_run_says_modelled_everywhere_and_its_text_is_a_placeholder():
    async with headless(RunSettings("sim:llama-3.1-8b@h100", tokens=24), size=SIZE) as run:
        shown = await screens(run)
    assert "positions per step, modelled" in shown[1]
    assert "modelled time per step" in shown[1] and "measured time" not in shown[1]
    for screen in (1, 2):
        assert "placeholder text" in shown[screen]  # Austen's opening, not the 8B model's
    assert "MODELLED" in shown[2] and "roofline" in shown[2] and "MEASURED" not in shown[2]
    assert "LIVE (modelled): llama-3.1-8b on sim: NVIDIA H100" in shown[3]
    assert "bf16: as vLLM serves bf16 weights" in shown[3]
    assert "Formula bytes, FLOPs / modelled time:" in shown[3]


async def test_a_replay_says_where_and_when_it_was_recorded_and_plays_only_that():
    """The shipped record, played back on this machine: replayed, recorded on cpu, its date;
    `l` and the length keys leave a recording's run alone (no "lesson mode" over its figures,
    no "r runs 256 tokens")."""
    async with headless(RunSettings(f"replay:{RECORD}"), size=SIZE) as run:
        shown = await screens(run)
        recorded = "recorded on cpu, 2026-12-02"
        assert f"replayed: {recorded}" in shown[1][: shown[1].index("1 ·")]  # the header
        assert "positions per step, replayed" in shown[1]
        assert "REPLAYED" in shown[2] and "wall time" in shown[2]
        assert f"REPLAY ({recorded}): tiny-austen" in shown[3]
        assert "Replayed (measured then, 1 thread):" in shown[3]
        assert "Next run" not in shown[3] and "LIVE" not in shown[3]
        await run.press("1", "right", "l")
        await run.settle()
        text = " ".join(run.text().split())
        assert "a recording: 44 prompt tokens (r replays)" in text and "r runs" not in text
        assert "lesson mode" not in text.replace("(l: lesson mode)", "")
        assert run.notifications[-1].startswith("A replay plays the run as it was recorded")
        assert len(run.engines) == 1  # l restarted nothing


async def test_the_what_if_follows_a_tensor_parallel_run_and_its_dtype():
    """sim:llama-3.1-70b@4xh100 holds half a million tokens per GPU: the what-if below it is
    the same split (one H100's share), not the whole 70B on one H100 (239%, OVERFLOW); and
    sim:deepseek-v3 runs and is priced in its published fp8 in both places."""
    async with headless(RunSettings("sim:llama-3.1-70b@4xh100", tokens=8), 3, size=SIZE) as run:
        await run.until_done()
        text = " ".join(run.text().split())
        budget = run.app.screen.budget()
        assert budget.tp == 4 and budget.fits and budget.max_context_tokens
        assert run.card("status").value == "FITS" and run.card("max-context").value != "0"
        assert "Llama 3.1 70B (bf16) on 4x" in text and "per GPU" in text
        await run.press("m")  # another model: the run's split was the run's model's
        assert run.app.screen.budget().tp == 1
    async with headless(RunSettings("sim:deepseek-v3@8xh200", tokens=8), 3, size=SIZE) as run:
        await run.until_done()
        text = " ".join(run.text().split())
        assert run.app.live.started.dtype == "fp8" == run.app.screen.budget().weights_dtype
        assert "DeepSeek-V3 (671B MoE) (fp8)" in text and "fp8: as vLLM serves fp8 weights" in text
        assert run.app.screen.budget().kv_dtype == "bf16"  # the activations' dtype, as served


async def test_a_gpu_nvml_cannot_read_is_said_in_plain_words():
    """A CUDA box without nvidia-ml-py (or with NVML refused): the header says "GPU, NVML
    unavailable" (not "CPU, no GPU", nor the library's name); help gives the reason; the
    what-if says why its GPU is an example."""
    probe = NullProbe("nvidia-ml-py is not installed (no pynvml module)", gpu_seen=True)
    summary = {"probe": "null", "label": probe.label(), "description": probe.describe()}
    async with headless("tiny", 3, engine=[], probe=summary, size=(160, 48)) as run:
        await run.settle()
        text = run.text()
        assert text.splitlines()[0].rstrip().endswith("GPU, NVML unavailable")
        assert "pynvml" not in text.splitlines()[0] and "CPU, no GPU" not in text
        assert "(an example: NVML cannot read this GPU)" in " ".join(text.split())
        await run.press("question_mark")
        assert "GPU, NVML unavailable: nvidia-ml-py is not installed" in run.text()


def test_a_replay_names_the_device_it_was_recorded_on():
    """A GPU by its name (not "cuda:0"), a CPU or a modelled GPU as the record says."""
    from kvtui.run.live import LiveRun

    _, events = read_record(RECORD)
    for device, words in (
        ("cuda:0 (NVIDIA H100 80GB HBM3)", "recorded on NVIDIA H100 80GB HBM3, 2026-12-02"),
        ("cpu", "recorded on cpu, 2026-12-02"),
        ("sim: NVIDIA H100 (SXM, 80GB)", "recorded on sim: NVIDIA H100 (SXM, 80GB), 2026-12-02"),
    ):
        run = LiveRun(RunSettings(f"replay:{RECORD}"))
        run.apply(replace(events[0], device=device))
        assert run.replayed and run.recorded == words
    undated = LiveRun(RunSettings(f"replay:{RECORD}"))
    undated.apply(replace(events[0], recorded_at="unknown"))  # an old record, no date anywhere
    assert undated.recorded == "recorded on cpu, date unknown"


async def test_a_modelled_speedup_names_the_gpu_and_where_the_step_turns_compute_bound():
    """Screen 2 on `sim:` says why the modelled time saves little: the run's start event names
    its catalog GPU and model (no engine name parsed), and the crossover is the roofline's."""
    from kvtui.sim.catalog import get_gpu, get_model
    from kvtui.sim.work import compute_bound_positions

    crossover = compute_bound_positions(get_model("llama-3.1-8b"), get_gpu("h100"))
    assert crossover is not None
    async with headless(
        RunSettings("sim:llama-3.1-8b@h100", tokens=24), screen=2, size=(160, 48)
    ) as run:
        assert await run.until_done() == "done"
        text = " ".join(run.text().split())
    assert f"until it recomputes about {crossover:,} positions" in text
    assert f"on the {get_gpu('h100').display_name} an uncached step" in text


async def test_screen_2s_title_follows_the_cache_toggle():
    """`c` turns the cache off: screen 2's title no longer says "you compute only the new
    token" over a screen that shows the uncached loop alone; `c` again puts it back."""
    async with headless(RunSettings("sim:llama-3.1-8b@h100", tokens=8), 2) as run:
        await run.until_done()
        titles = []
        for _ in range(3):
            titles.append(run.text().splitlines()[1].strip())
            await run.press("c")
            await run.settle()
    on = "2 · With the cache, you compute only the new token"
    assert titles[0] == titles[2] == on
    assert titles[1].startswith("2 · The cache is off: every step computes every position")


async def test_a_modelled_run_never_says_measured_on_screens_1_2_or_the_presenter():
    """A `sim:` run, before it starts and stalled mid-run (its engine held after a few steps):
    screens 1 and 2 and presenter mode never call a figure measured (screen 1's captions said
    "measured" until the engine started; the presenter's pace said "(12 measured so far)")."""
    from kvtui.testing import ScriptedEngine

    settings = RunSettings("sim:llama-3.1-8b@h100", tokens=24, lesson=True)

    def said(text: str) -> str:
        words = " ".join(text.split()).lower()  # a label in capitals too ("MEASURED")
        # what is not a claim: "modelled (roofline), not measured", the title's list of kinds
        return words.replace("not measured", "").replace("measured, recorded or modelled", "")

    async with headless(settings, 1, size=SIZE, autostart=False) as run:
        await run.settle()
        assert "measured" not in said(run.text())

    def held(s: RunSettings) -> ScriptedEngine:
        return ScriptedEngine.from_settings(s, hold_at=14)  # the start and a few steps a loop

    for present in (False, True):
        async with headless(settings, 1, size=SIZE, engine=held, present=present) as run:
            await run.wait_for(lambda: run.engine is not None and len(run.engine.sent) == 14)
            await run.settle()
            pages = []
            for key in ["space"] * 12 if present else ["2", "c", "c"]:
                pages.append(said(run.text()))
                await run.press(key)
                await run.settle()
            bad = [p[p.index("measured") - 200 :][:300] for p in pages if "measured" in p]
            assert bad == [], bad
