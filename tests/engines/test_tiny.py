"""The shipped model: found, loaded without pickle, the right shape, trained, reproducible."""

import json
import subprocess
import sys
import zipfile

import pytest
import torch

from kvtui.engines.roofline import PASSAGE
from kvtui.gpu.load import TINY_ARGS, load_tiny
from kvtui.gpu.model import Transformer
from kvtui.paths import TINY_WEIGHTS, asset_path
from kvtui.sim.catalog import get_model
from kvtui.training.train import TrainConfig, encode, evaluate, train


@pytest.fixture(scope="module")
def tiny():
    return load_tiny(torch.device("cpu"), torch.float32)


def test_the_weights_ship_as_fp16_safetensors_that_load_as_their_config_says(tiny):
    """What the engine relies on in the shipped file: a header kvtui's own reader accepts (the
    app reads it without torch, `tiny_positions`), fp16 tensors only, and metadata whose config
    is the model `load_tiny` builds (the same shape as the fallback, TINY_ARGS), whose positions
    the app offers, and whose trained context the engine reports; small enough for a wheel."""
    from kvtui.engines.factory import tiny_positions
    from kvtui.gpu.load import trained_context
    from kvtui.gpu.model import ModelArgs
    from kvtui.inputs import safetensors_header

    path = asset_path(TINY_WEIGHTS)
    header = safetensors_header(path)  # no pickle: a JSON header and raw tensors
    meta = header.pop("__metadata__")
    assert {t["dtype"] for t in header.values()} == {"F16"}
    model, loaded = tiny
    assert loaded == meta
    config = ModelArgs.from_json(json.loads(meta["config"]))
    assert model.args == config == TINY_ARGS
    state = model.state_dict()
    assert sorted(header) == sorted(state)
    assert all(list(state[name].shape) == t["shape"] for name, t in header.items())
    assert tiny_positions() == config.max_positions
    assert trained_context(meta) == int(meta["context_trained"]) <= config.max_positions
    assert meta["name"] == "tiny-austen" == get_model(meta["name"]).name  # the label is known
    assert path.stat().st_size < 10 * 2**20


def test_model_args_read_from_json_ignore_what_they_do_not_know():
    """`ModelArgs.from_json` takes a config with keys it does not know (a newer trainer's) and
    gives back exactly what `to_json` wrote."""
    from kvtui.gpu.model import ModelArgs

    args = ModelArgs(n_layer=2, n_head=4, n_kv_head=1, dim=64, head_dim_override=32)
    assert ModelArgs.from_json(args.to_json()) == args
    assert ModelArgs.from_json({**args.to_json(), "dropout": 0.1, "tied": True}) == args
    assert ModelArgs.from_json({"n_layer": 3}) == ModelArgs(n_layer=3)


def test_shape_and_parameter_count(tiny):
    model, meta = tiny
    a = model.args
    assert (a.n_layer, a.n_head, a.n_kv_head, a.head_dim, a.vocab_size) == (6, 8, 2, 32, 256)
    assert a.n_kv_head < a.n_head  # grouped-query attention
    assert a == TINY_ARGS
    count = sum(p.numel() for p in model.parameters())
    assert count == a.params == int(meta["params"]) == get_model("tiny-austen").params
    spec = get_model("tiny-austen")
    assert (spec.layers, spec.heads, spec.kv_heads, spec.head_dim) == (6, 8, 2, 32)


def test_on_the_cpu_its_weights_are_laid_out_for_the_one_token_step(tiny):
    """`load_tiny` on a CPU stores every linear weight transposed (`ready_to_decode`), with the
    values of the shipped file."""
    from safetensors import safe_open

    model, _ = tiny
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 4 * model.args.n_layer + 1  # wqkv, wo, w13, w2 a layer; the output
    assert all(m.weight.t().is_contiguous() for m in linears.values())
    with safe_open(asset_path(TINY_WEIGHTS), framework="pt") as f:
        shipped = f.get_tensor("layers.0.feed_forward.w13.weight").float()
    assert torch.equal(linears["layers.0.feed_forward.w13"].weight, shipped)


def test_the_trained_model_knows_austen(tiny):
    model, _ = tiny
    loss = evaluate(model, encode(PASSAGE * 4), context=256, max_windows=None)
    untrained = Transformer(TINY_ARGS)
    untrained.init_weights(0)
    assert (
        loss < 2.0 < evaluate(untrained.eval(), encode(PASSAGE * 4), context=256, max_windows=None)
    )


def test_rope_runs_mechanically_to_4096_positions(tiny):
    model, _ = tiny
    with torch.inference_mode():
        model.setup_caches(1, 4096)
        model(torch.zeros(1, 4095, dtype=torch.long), start=0, use_cache=True)
        logits = model(torch.zeros(1, 1, dtype=torch.long), start=4095, use_cache=True)
        model.drop_caches()
    assert torch.isfinite(logits).all()


def test_a_seeded_sample_is_reproducible_across_runs():
    cmd = [
        sys.executable,
        "-m",
        "kvtui",
        "bench",
        "--device",
        "cpu",
        "--tokens",
        "40",
        "--seed",
        "11",
        "--json",
    ]
    runs = [
        json.loads(
            subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
        )
        for _ in range(2)
    ]
    assert runs[0]["text"] == runs[1]["text"] and runs[0]["identical"]
    assert runs[0]["model"] == "tiny-austen"


def test_a_short_training_run_lowers_the_loss():
    from kvtui.gpu.model import ModelArgs

    text = encode(PASSAGE * 20)
    args = ModelArgs(
        n_layer=1, n_head=2, n_kv_head=1, dim=32, intermediate_size=64, max_positions=64
    )
    cfg = TrainConfig(
        batch_size=4,
        context=32,
        max_steps=30,
        lr=3e-3,
        warmup_steps=3,
        eval_every=30,
        eval_windows=8,
        threads=1,
    )
    before = evaluate(_fresh(args, cfg.seed), text, cfg.context, cfg.eval_windows)
    _, state = train(args, cfg, text, text)
    assert state["step"] == 30 and state["val_loss"] < before - 0.5


def test_training_resumes_where_it_stopped(tmp_path):
    from kvtui.gpu.model import ModelArgs

    text = encode(PASSAGE * 10)
    args = ModelArgs(
        n_layer=1, n_head=2, n_kv_head=1, dim=32, intermediate_size=64, max_positions=64
    )
    cfg = TrainConfig(
        batch_size=2,
        context=16,
        max_steps=6,
        warmup_steps=2,
        eval_every=6,
        eval_windows=4,
        checkpoint_every=3,
        threads=1,
    )
    straight, _ = train(args, cfg, text, text)
    ckpt = tmp_path / "ckpt.safetensors"
    train(args, cfg, text, text, checkpoint=ckpt, stop_after_steps=3)
    resumed, state = train(args, cfg, text, text, checkpoint=ckpt)
    assert state["step"] == 6
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=name)


def _fresh(args, seed):
    model = Transformer(args)
    model.init_weights(seed)
    return model


def test_assets_are_found_from_an_installed_wheel(tmp_path):
    root = asset_path(TINY_WEIGHTS).parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(root),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("kvtui-*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import torch; from kvtui.paths import asset_path;"
        "from kvtui.gpu.load import load_tiny;"
        "from kvtui.sim.catalog import get_model;"
        "m, meta = load_tiny(torch.device('cpu'), torch.float32);"
        "print(asset_path('tiny-austen.safetensors'), meta['name'], get_model('gpt2').layers)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    path, name, layers = out.stdout.split()
    assert path.startswith(str(site)) and name == "tiny-austen" and layers == "12"
