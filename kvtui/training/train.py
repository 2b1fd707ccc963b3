"""Training the shipped tiny model on bytes of text, on the CPU, without a UI.

Deterministic (batches are drawn from a generator seeded by (seed, step), so a resumed run sees the
same batches as an unbroken one), resumable (model and optimizer state in safetensors, never
pickle) and logged (step, elapsed time, train and validation loss in nats per byte).

A run may start from trained weights (`init_from`) and follow a window schedule (`windows`: from
step S on, batches of B windows of T bytes), which is how the shipped model learned long context:
first 512-byte windows, then continued on windows up to 4,096 bytes. Validation is also reported
by position bucket (`evaluate_by_position`), since a model that is good on average can still fail
late in a long window. `scripts/train_tiny.py` is the command line; the tests call `train()` on a
tiny slice.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvtui.gpu.model import ModelArgs, Transformer

POSITION_BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, 3072), (3072, 4096))
"""Position ranges (start inclusive, end exclusive) over which validation loss is reported."""


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1337
    batch_size: int = 8
    context: int = 512
    """Window length and batch before any `windows` phase, and the validation window."""
    windows: tuple[tuple[int, int, int], ...] = ()
    """The window schedule: `(from_step, context, batch_size)` phases in step order."""
    max_steps: int = 2400
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 48
    checkpoint_every: int = 50
    threads: int = 2


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as a uint8 tensor: the model's tokens."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr` at `max_steps` (as nanoGPT)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def window_at(step: int, cfg: TrainConfig) -> tuple[int, int]:
    """`(context, batch_size)` of the batch at `step`, from the window schedule."""
    context, batch = cfg.context, cfg.batch_size
    for from_step, phase_context, phase_batch in cfg.windows:
        if step >= from_step:
            context, batch = phase_context, phase_batch
    return context, batch


def bytes_seen(cfg: TrainConfig, steps: int) -> int:
    """Bytes of training windows in the first `steps` steps."""
    return sum(math.prod(window_at(step, cfg)) for step in range(steps))


def get_batch(data: torch.Tensor, cfg: TrainConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `context + 1` bytes, the same for a given (seed, step)."""
    context, batch = window_at(step, cfg)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
    windows = torch.stack([data[s : s + context + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(
    model: Transformer, data: torch.Tensor, context: int, max_windows: int | None
) -> float:
    """Mean loss in nats per byte over non-overlapping windows of `data` (all of them, or the
    first `max_windows` evenly spread)."""
    model.eval()
    n_windows = (len(data) - 1) // context
    indices = range(n_windows)
    if max_windows is not None and n_windows > max_windows:
        indices = [round(i * (n_windows - 1) / (max_windows - 1)) for i in range(max_windows)]
    total, count = 0.0, 0
    for i in indices:
        window = data[i * context : i * context + context + 1].long()[None]
        logits = model(window[:, :-1])
        total += F.cross_entropy(
            logits.view(-1, logits.size(-1)), window[0, 1:], reduction="sum"
        ).item()
        count += context
    model.train()
    return total / count


@torch.no_grad()
def evaluate_by_position(
    model: Transformer,
    data: torch.Tensor,
    context: int,
    max_windows: int | None,
    buckets: tuple[tuple[int, int], ...] = POSITION_BUCKETS,
) -> tuple[float, dict[str, float]]:
    """Mean loss in nats per byte over non-overlapping windows of `context` bytes (all of them,
    or `max_windows` evenly spread): over every position, and at each bucket of positions, keyed
    `"START-END"` (END inclusive, as people write ranges; buckets are cut at `context`)."""
    model.eval()
    n_windows = (len(data) - 1) // context
    indices = range(n_windows)
    if max_windows is not None and n_windows > max_windows:
        indices = [round(i * (n_windows - 1) / (max_windows - 1)) for i in range(max_windows)]
    per_position = torch.zeros(context, dtype=torch.float64)
    for i in indices:
        window = data[i * context : i * context + context + 1].long()[None]
        logits = model(window[:, :-1])
        per_position += F.cross_entropy(logits[0], window[0, 1:], reduction="none").double()
    per_position /= len(indices)
    model.train()
    by_bucket = {
        f"{start}-{min(end, context) - 1}": per_position[start : min(end, context)].mean().item()
        for start, end in buckets
        if start < context
    }
    return per_position.mean().item(), by_bucket


def _optimizer(model: Transformer, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=False)


def _save_checkpoint(path: Path, model: Transformer, opt: torch.optim.AdamW, state: dict) -> None:
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            tensors[f"opt.{names[id(p)]}.{key}"] = torch.as_tensor(s[key]).reshape(-1).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"state": json.dumps(state)})
    tmp.replace(path)


def _load_checkpoint(path: Path, model: Transformer, opt: torch.optim.AdamW) -> dict:
    from safetensors import safe_open

    tensors = load_file(path)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    for name, p in model.named_parameters():
        if f"opt.{name}.exp_avg" in tensors:
            opt.state[p] = {
                "exp_avg": tensors[f"opt.{name}.exp_avg"].view_as(p).clone(),
                "exp_avg_sq": tensors[f"opt.{name}.exp_avg_sq"].view_as(p).clone(),
                "step": tensors[f"opt.{name}.step"].reshape(()).clone(),
            }
    with safe_open(path, "pt") as f:
        return json.loads(f.metadata()["state"])


def train(
    args: ModelArgs,
    cfg: TrainConfig,
    train_data: torch.Tensor,
    val_data: torch.Tensor,
    *,
    checkpoint: Path | None = None,
    init_from: Path | None = None,
    log: Callable[[dict], None] = lambda record: None,
    stop_after_steps: int | None = None,
) -> tuple[Transformer, dict]:
    """Train (or resume from `checkpoint`) until `cfg.max_steps`; return the model and its state
    (`step`, `train_seconds`, `val_loss` and the log of evaluations). A new run starts from the
    weights in `init_from` (safetensors, any float dtype) when given, else from a seeded init."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    model = Transformer(args)
    model.init_weights(cfg.seed)
    if init_from is not None:
        weights = load_file(init_from)
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    opt = _optimizer(model, cfg)
    state = {"step": 0, "train_seconds": 0.0, "val_loss": None, "history": []}
    if checkpoint is not None and checkpoint.exists():
        state = _load_checkpoint(checkpoint, model, opt)
        log({"event": "resumed", "step": state["step"]})
    model.train()
    started = time.perf_counter() - state["train_seconds"]
    last_steps = stop_after_steps if stop_after_steps is not None else cfg.max_steps
    while state["step"] < min(cfg.max_steps, last_steps):
        step = state["step"]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = get_batch(train_data, cfg, step)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        state["step"] = step + 1
        state["train_seconds"] = time.perf_counter() - started
        record = {
            "step": step + 1,
            "seconds": round(state["train_seconds"], 1),
            "train_loss": round(loss.item(), 4),
        }
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
            context = max(window_at(step, cfg)[0], cfg.context)
            loss_all, buckets = evaluate_by_position(model, val_data, context, cfg.eval_windows)
            state["val_loss"] = loss_all
            record["val_loss"] = round(state["val_loss"], 4)
            record["val_loss_by_position"] = {k: round(v, 4) for k, v in buckets.items()}
            state["history"].append(record)
        log(record)
        if checkpoint is not None and (
            (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.max_steps
        ):
            _save_checkpoint(checkpoint, model, opt, state)
    return model, state


def export_weights(model: Transformer, path: Path, metadata: dict) -> None:
    """The shipped weights: fp16 safetensors, with the config and provenance as metadata."""
    tensors = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    meta = {"config": json.dumps(model.args.to_json())}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
    save_file(tensors, path, metadata=meta)


def train_config_json(cfg: TrainConfig) -> dict:
    return asdict(cfg)
