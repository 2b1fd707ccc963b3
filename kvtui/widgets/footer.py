"""Textual's Footer without its leak: the keys it replaces on every switch of screen are let go.

Textual's `Footer` rebuilds its `FooterKey`s whenever the screen's bindings change (each switch
of screen does), and every key follows the footer's `compact` reactive through `data_bind`. That
leaves a watcher `(key, callback)` in the footer's list for `compact`, which Textual prunes only
when `compact` next changes (`Reactive._check_watchers`, textual/reactive.py; the entry is
added by `_watch`, called from `DOMNode._initialize_data_bind` in textual/dom.py). In kvtui it
never changes, so every replaced key stayed alive with its styles and render caches: about
300 KB a switch of screens, without bound (Textual 8.2.8; upstream: Textualize/textual#6666).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer
from textual.widgets._footer import FooterKey  # exported by no public module


class KeysFooter(Footer):
    """A `Footer` that drops the watchers of the keys it has just replaced, builds its keys
    again only when the keys it would show have changed, and builds each as compact as it is
    (its class set before it is first styled: Textual's binding sets it once mounted, which
    styled every key a second time)."""

    _built_for: tuple[tuple[Binding, bool, str], ...] | None = None
    """The bindings the keys were last built for: (binding, enabled, tooltip) of each shown."""

    def compose(self) -> ComposeResult:
        for widget in super().compose():
            if isinstance(widget, FooterKey):
                widget.set_class(self.compact, "-compact", update=False)
            yield widget

    def _keys_shown(self) -> tuple[tuple[Binding, bool, str], ...] | None:
        """What `compose` would show now (None before the screen's bindings are ready, or once
        the footer has left its screen)."""
        if not self._bindings_ready or not self.is_attached:
            return None
        active = self.screen.active_bindings.values()
        return tuple((b, enabled, tooltip) for (_, b, enabled, tooltip) in active if b.show)

    async def recompose(self) -> None:
        shown = self._keys_shown()
        if shown is not None and shown == self._built_for:
            return  # the very keys shown (a screen's bindings are updated on each resume)
        self._built_for = shown
        await super().recompose()
        # The replaced keys are closed by now; setting `compact` to itself runs Textual's own
        # pruning of closed watchers (and tells the new keys the value they already have).
        self.mutate_reactive(Footer.compact)
