"""Train the shipped `tiny-austen` model on Jane Austen's six novels, then export it to assets/.

    apt-get install r-cran-janeaustenr          # the corpus (MIT package; public-domain novels)
    python scripts/train_tiny.py                # resumable: run it again to continue
    python scripts/train_tiny.py --export       # evaluate on the whole validation split, write
                                                # assets/tiny-austen.safetensors

Logs one JSON line per step (step, seconds, train loss; validation loss every `eval_every`) to
stdout and to runs/tiny/log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvtui.corpus import DEBIAN_DATA_DIR, austen_novels, train_val_split
from kvtui.gpu.model import ModelArgs
from kvtui.gpu.train import TrainConfig, encode, evaluate, export_weights, train, train_config_json
from kvtui.paths import assets_dir

MODEL = ModelArgs(n_layer=6, n_head=8, n_kv_head=2, dim=256, intermediate_size=512)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", type=Path, default=DEBIAN_DATA_DIR)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/tiny"))
    parser.add_argument("--max-steps", type=int, default=TrainConfig.max_steps)
    parser.add_argument("--threads", type=int, default=TrainConfig.threads)
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
    cfg = replace(TrainConfig(), max_steps=args.max_steps, threads=args.threads)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.run_dir / "checkpoint.safetensors"
    with open(args.run_dir / "log.jsonl", "a") as log_file:

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
            log=log,
        )
        if not args.export:
            return 0
        val_loss = evaluate(model, val_data, cfg.context, max_windows=None)
        log({"event": "final", "val_loss_nats_per_byte": val_loss, "step": state["step"]})
        export_weights(
            model,
            assets_dir() / "tiny-austen.safetensors",
            {
                "name": "tiny-austen",
                "params": model.num_params(),
                "steps": state["step"],
                "tokens_seen": state["step"] * cfg.batch_size * cfg.context,
                "train_seconds": round(state["train_seconds"], 1),
                "val_loss_nats_per_byte": round(val_loss, 4),
                "val_split": "last 5% of each novel, non-overlapping 512-byte windows",
                "train": train_config_json(cfg),
                "corpus": "Jane Austen's six novels, from Debian's r-cran-janeaustenr 1.0.0",
                "licence": "novels: public domain (Project Gutenberg); janeaustenr package: MIT",
                "trained_with": "scripts/train_tiny.py",
                "note": args.note,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
