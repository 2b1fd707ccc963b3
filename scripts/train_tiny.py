"""Train the shipped `tiny-austen` model on Jane Austen's six novels, then export it to assets/.

    apt-get install r-cran-janeaustenr              # the corpus (MIT package; public-domain novels)
    python scripts/train_tiny.py --stage base       # 512-byte windows from a seeded init
    python scripts/train_tiny.py --stage long       # then windows up to 4,096 bytes, starting
                                                    # from the shipped (or --init) weights
    python scripts/train_tiny.py --stage long --export   # evaluate on the whole validation split
                                                    # by position bucket, write the assets file

Each stage is resumable: run the same command again and it continues from its last checkpoint in
`--run-dir` (runs/tiny or runs/tiny-long).

Logs one JSON line per step (step, seconds, train loss; validation loss every `eval_every`) to
stdout and to runs/tiny/log.jsonl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvtui.gpu.model import ModelArgs
from kvtui.paths import assets_dir
from kvtui.training.corpus import DEBIAN_DATA_DIR, austen_novels, train_val_split
from kvtui.training.train import (
    TrainConfig,
    bytes_seen,
    encode,
    evaluate,
    evaluate_by_position,
    export_weights,
    train,
    train_config_json,
)

MODEL = ModelArgs(n_layer=6, n_head=8, n_kv_head=2, dim=256, intermediate_size=512)

STAGES = {
    # The first 2,000 steps: 8 windows of 512 bytes a step (87 minutes on 2 threads).
    "base": TrainConfig(max_steps=2000),
    # Long context, from the base weights: 4,096 bytes a step as 2 x 2,048, then 1 x 4,096.
    "long": TrainConfig(
        context=4096,
        windows=((0, 2048, 2), (200, 4096, 1)),
        max_steps=1000,
        lr=6e-4,
        min_lr=6e-5,
        warmup_steps=30,
        eval_every=100,
        eval_windows=8,
        checkpoint_every=25,
        threads=1,
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", choices=sorted(STAGES), default="long")
    parser.add_argument("--data-dir", type=Path, default=DEBIAN_DATA_DIR)
    parser.add_argument("--run-dir", type=Path, help="default: runs/tiny or runs/tiny-long")
    parser.add_argument("--init", type=Path, help="weights to start the long stage from")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--note", default="", help="a line of provenance for the exported file")
    parser.add_argument("--export", action="store_true", help="export the checkpoint to assets/")
    args = parser.parse_args()

    if not args.data_dir.is_dir():
        print(
            f"error: no corpus at {args.data_dir}: apt-get install r-cran-janeaustenr",
            file=sys.stderr,
        )
        return 2
    train_text, val_text = train_val_split(austen_novels(args.data_dir))
    train_data, val_data = encode(train_text), encode(val_text)
    cfg = STAGES[args.stage]
    if args.max_steps is not None:
        cfg = replace(cfg, max_steps=args.max_steps)
    if args.threads is not None:
        cfg = replace(cfg, threads=args.threads)
    run_dir = args.run_dir or Path("runs/tiny" if args.stage == "base" else "runs/tiny-long")
    init = None
    if args.stage == "long":
        init = args.init or assets_dir() / "tiny-austen.safetensors"
        if not init.is_file():
            print(f"error: no weights to start from at {init}", file=sys.stderr)
            return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    if init is not None:
        # The run keeps its own copy: exporting replaces the shipped file it started from.
        kept = run_dir / "init.safetensors"
        if not kept.exists():
            shutil.copyfile(init, kept)
        init = kept
    checkpoint = run_dir / "checkpoint.safetensors"
    with open(run_dir / "log.jsonl", "a") as log_file:

        def log(record: dict) -> None:
            line = json.dumps({"time": time.strftime("%H:%M:%S"), **record})
            print(line, flush=True)
            log_file.write(line + "\n")
            log_file.flush()

        log(
            {
                "event": "start",
                "train_bytes": len(train_data),
                "val_bytes": len(val_data),
                "stage": args.stage,
                "init": str(init) if init else None,
                "model": MODEL.to_json(),
                "train": train_config_json(cfg),
            }
        )
        model, state = train(
            MODEL,
            cfg,
            train_data,
            val_data,
            checkpoint=checkpoint,
            init_from=init,
            log=log,
        )
        if not args.export:
            return 0
        val_loss = evaluate(model, val_data, 512, max_windows=None)
        _, by_position = evaluate_by_position(model, val_data, cfg.context, max_windows=None)
        log(
            {
                "event": "final",
                "val_loss_nats_per_byte": val_loss,
                "val_loss_by_position": by_position,
                "step": state["step"],
            }
        )
        provenance = _base_provenance(init) if init else {}
        export_weights(
            model,
            assets_dir() / "tiny-austen.safetensors",
            {
                "name": "tiny-austen",
                "params": model.args.params,
                "steps": state["step"],
                "context_trained": cfg.context,
                "tokens_seen": bytes_seen(cfg, state["step"]),
                "train_seconds": round(state["train_seconds"], 1),
                "val_loss_nats_per_byte": round(val_loss, 4),
                "val_loss_by_position": {k: round(v, 4) for k, v in by_position.items()},
                "val_split": "last 5% of each novel; loss over non-overlapping 512-byte windows, "
                f"by position over non-overlapping {cfg.context}-byte windows",
                "train": train_config_json(cfg),
                **provenance,
                "corpus": "Jane Austen's six novels, from Debian's r-cran-janeaustenr 1.0.0",
                "licence": "novels: public domain (Project Gutenberg); janeaustenr package: MIT",
                "trained_with": "scripts/train_tiny.py",
                "note": args.note,
            },
        )
    return 0


def _base_provenance(init: Path) -> dict:
    """What the long stage started from: the file's digest and its own training record."""
    from safetensors import safe_open

    with safe_open(init, "pt") as f:
        meta = f.metadata() or {}
    keep = ("steps", "train_seconds", "tokens_seen", "val_loss_nats_per_byte", "train")
    return {
        "init": {
            "sha256": hashlib.sha256(init.read_bytes()).hexdigest(),
            **{k: json.loads(meta[k]) for k in keep if k in meta},
        }
    }


if __name__ == "__main__":
    raise SystemExit(main())
