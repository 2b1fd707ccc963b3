"""Print samples from the shipped tiny model, as the README shows them, and measure how far
they read as Austen.

    python scripts/sample.py --seeds 1 2 3 --tokens 300
    python scripts/sample.py --seeds 1 2 3 --tokens 4000 --tail 1000 --vocabulary

Seeded top-k sampling with the app's defaults (temperature 0.8, top-k 40) through the cached loop;
the same seed gives the same text on every run. `--vocabulary` measures the last `--tail`
characters: the share of their words (runs of letters, lowercased) that occur anywhere in the six
novels' training split (Debian's r-cran-janeaustenr), against the same share for the held-out
end of the novels (Austen herself, unseen).
Invented words ("Fannyeyhed", "dancholy") are what a model past its trained context writes.
"""

from __future__ import annotations

import argparse
import re

import torch

from kvtui.engines.generate import encode_text, generate
from kvtui.engines.loops import Sampling
from kvtui.engines.protocol import DEFAULT_PROMPT
from kvtui.gpu.load import load_tiny
from kvtui.text import decode_bytes
from kvtui.training.corpus import austen_novels, train_val_split


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--tail", type=int, default=0, help="print only the last N characters")
    parser.add_argument("--vocabulary", action="store_true", help="measure the tail's words")
    args = parser.parse_args()
    vocabulary = austen_vocabulary() if args.vocabulary else None
    torch.set_num_threads(1)
    model, meta = load_tiny(torch.device("cpu"), torch.float32)
    print(f"# {meta.get('name')}: validation loss {meta.get('val_loss_nats_per_byte')} nats/byte")
    for seed in args.seeds:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, seed=seed)
        steps = generate(model, encode_text(args.prompt), args.tokens, sampling, cache=True)
        text = args.prompt + decode_bytes([s.token_id for s in steps])
        shown = text[-args.tail :] if args.tail else text
        print(f"\n## seed {seed}\n\n{shown}")
        if vocabulary is not None:
            known, words = known_share(shown, vocabulary)
            print(
                f"\n(words of the last {len(shown):,} characters in Austen's vocabulary: "
                f"{known:.1%} of {words})"
            )
    if vocabulary is not None:
        _, val = train_val_split(austen_novels())
        known, words = known_share(val[-(args.tail or 1000) :], vocabulary)
        print(f"\n(for comparison, held-out Austen: {known:.1%} of {words} words)")
    return 0


WORD = re.compile(r"[A-Za-z]+")


def austen_vocabulary() -> set[str]:
    """Every word of the novels' training split (the model's own reading), lowercased."""
    train, _ = train_val_split(austen_novels())
    return {w.lower() for w in WORD.findall(train)}


def known_share(text: str, vocabulary: set[str]) -> tuple[float, int]:
    """The share of `text`'s words found in `vocabulary`, and how many words there were."""
    words = [w.lower() for w in WORD.findall(text)]
    return (sum(w in vocabulary for w in words) / len(words) if words else 0.0), len(words)


if __name__ == "__main__":
    raise SystemExit(main())
