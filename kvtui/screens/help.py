"""Help: the keys, where the engine runs, and the story the four screens tell."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from kvtui.widgets.plain import template

HELP = """\
[b]kvtui[/b]: why LLM decoding needs a KV cache, measured while you watch.
Figures are [b]measured[/b], [b]modelled[/b] (sim:, what-if) or the [b]formula[/b] (dotted).
[b]1[/b] Without a cache, every step recomputes all tokens' keys and values.
[b]2[/b] With the cache each step computes one new position and reads the rest.
[b]3[/b] The cache grows with each token and sequence until its memory runs out.
[b]4[/b] Tricks stretch it: fewer bytes a token, fewer tokens, shared prefixes.
[b]Device[/b] $device
  1 2 3 4      switch screen; on 4, k + - r: race a trick, set it, again
  space        pause / resume the engine
  ← → - +      answer length (1, 2; shift+← → halve, double); context (3)
  r            run again, exactly the chosen length
  l            lesson mode: a 1-token prompt, the lesson's exact counts
  c            cache on / off (2)
  v            work per step or running totals (2, short terminals)
  [ ] \\        next run's KV budget: smaller, larger, default (3)
  n            next run's batch: 1, 2, 4 ... 64 sequences (3)
  f            fill a vllm:URL server's KV cache: a bounded load (3)
  m g k b      what-if model, GPU, KV dtype, batch (3)
  t  p         explain it back (the lesson's questions); presenter mode
  ctrl+p       command palette: engines, what-if, themes, screenshot
  ?  q ctrl+c  this help (escape closes it); quit"""


class HelpScreen(ModalScreen[None]):
    """The keys, the device in full (the header shortens it) and the lesson in a few lines."""

    BINDINGS = [Binding("escape,question_mark", "app.pop_screen", "Close")]

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device or "not probed yet"

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(template(HELP, device=self.device))  # the probe's words
