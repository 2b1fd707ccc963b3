"""Print samples from the shipped tiny model, as the README shows them.

    python scripts/sample.py --seeds 1 2 3 --tokens 300

Seeded top-k sampling with the app's defaults (temperature 0.8, top-k 40) through the cached loop;
the same seed gives the same text on every run.
"""

from __future__ import annotations

import argparse

import torch

from kvtui.engine.protocol import DEFAULT_PROMPT
from kvtui.engine.torch_engine import Sampling, encode_text, generate, load_tiny
from kvtui.text import decode_bytes


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, meta = load_tiny(torch.device("cpu"), torch.float32)
    print(f"# {meta.get('name')}: validation loss {meta.get('val_loss_nats_per_byte')} nats/byte")
    for seed in args.seeds:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, seed=seed)
        steps = generate(model, encode_text(args.prompt), args.tokens, sampling, cache=True)
        text = decode_bytes([s.token_id for s in steps])
        print(f"\n## seed {seed}\n\n{args.prompt}{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
