"""Help: the keys, and the story the three screens tell."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]kvtui[/b]: why LLM decoding needs a KV cache, measured while you watch.

[b]1[/b] Without a cache every step recomputes the keys and values of the whole history.
[b]2[/b] With the cache each step computes one new position and reads the rest back.
[b]3[/b] The cache grows with every token and batch entry until GPU memory runs out.

[b]Keys[/b]
  1 2 3        switch screen
  space        pause / resume the engine
  r            restart the run
  c            cache on / off (screen 2)
  ← → - +      answer length (1, 2) or context (3; - + halve and double)
  m g k b      model, GPU, KV dtype, batch (3)
  t            quiz (3)
  ctrl+p       command palette: engine, model and GPU
  ?            this help
  q            quit

Press escape or ? to close."""


class HelpScreen(ModalScreen[None]):
    """The keys and the lesson in a few lines."""

    BINDINGS = [Binding("escape,question_mark", "app.pop_screen", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP)
