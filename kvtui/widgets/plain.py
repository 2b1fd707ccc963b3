"""Text from outside kvtui on screen: always text, never markup.

A record, a model's config.json, a folder's name, the device probe and an engine's message may
hold anything, `[/dim]` and `[@click=app.quit]` included. Textual reads a plain `str` given to a
widget (`Static.update`, `border_title`) as markup, where such text crashes the app (a closing tag
that matches nothing) or puts an action on screen; escaping cannot be trusted with it (Rich's and
Textual's `escape` leave `[$name]`, `[B]` and `[ b]` as markup). So text from outside reaches a
widget only as `Content`, built here: `plain` for text alone, `template` for kvtui's own markup
with the outside text in its `$name` slots, which Textual fills as text and never parses. Control
characters are escaped as kvtui.format.safe_text has them.
"""

from __future__ import annotations

from textual.content import Content

from kvtui.format import safe_text


def plain(text: object) -> Content:
    """`text` as it is, never markup (control characters escaped)."""
    return Content(safe_text(str(text)))


def template(markup: str, **values: object) -> Content:
    """kvtui's own `markup` (a literal, with `$name` slots) filled with outside `values`, each
    shown as it is, never read as markup: `template("[b]Live[/b] ($timing)", timing=t)`."""
    return Content.from_markup(markup, **{k: safe_text(str(v)) for k, v in values.items()})
