"""A line of text that a screen rewrites while a run streams, at the cost of a repaint only."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


class Note(Static):
    """A Static for text set again and again (a run note, a card's figure, a status mark).

    `show` does nothing when the text is unchanged, and otherwise repaints this widget alone; it
    asks for a layout of the screen only when the new text needs another height (a note that
    wraps onto a second line). `Static.update` lays out the whole screen on every call, 10 times
    a second while a run streams, and on a key that changes the run note that layout cost more
    than repainting the note.
    """

    def __init__(
        self, text: str = "", *, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(text, id=id, classes=classes)
        self._text: str | Content = text

    def show(self, text: str | Content) -> None:
        """Show `text` (a `str` is read as markup: text from outside comes as `Content`, as
        kvtui.widgets.plain makes it); a layout only if it takes another number of lines than
        the text before."""
        if text == self._text:
            return
        self._text = text
        lines = self.content_size.height
        self.update(text, layout=False)
        height = self.styles.height
        if height is not None and not height.is_auto:
            return  # the stylesheet fixes the height, whatever the text
        width = self.content_size.width
        if width and self.get_content_height(self.container_size, self.app.size, width) != lines:
            self.refresh(layout=True)
