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

from textual.widgets import Footer


class KeysFooter(Footer):
    """A `Footer` that drops the watchers of the keys it has just replaced."""

    async def recompose(self) -> None:
        await super().recompose()
        # The replaced keys are closed by now; setting `compact` to itself runs Textual's own
        # pruning of closed watchers (and tells the new keys the value they already have).
        self.mutate_reactive(Footer.compact)
