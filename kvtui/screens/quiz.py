"""The lesson's closing question, with feedback on each answer."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

QUESTION = (
    "A model has plenty of compute left, but a long chat suddenly refuses to continue. "
    "Why, and what actually ran out?"
)

ANSWERS: tuple[tuple[str, bool, str], ...] = (
    (
        "Compute: attention over a long chat needs more FLOPs than the GPU has.",
        False,
        "Not quite: a decode step does about 2 FLOPs per parameter plus a little attention, far "
        "below the GPU's peak. Compute was left over; something else filled up.",
    ),
    (
        "GPU memory: the KV cache grew with every token and ran out of room.",
        True,
        "Right. Every token keeps its keys and values in every layer; past the memory left "
        "after the weights, the next token has nowhere to go. Shorter context, smaller batch, "
        "a smaller KV dtype or a bigger GPU are the ways out.",
    ),
    (
        "The weights got bigger as the chat went on.",
        False,
        "No: the weights are the same size at token 1 and token 100,000. What grows is the "
        "cache of keys and values, one entry per token per layer.",
    ),
    (
        "The model forgot the start of the chat, so it stopped.",
        False,
        "Forgetting is a different limit (the model's trained context). The refusal here is "
        "physical: the KV cache no longer fits in GPU memory.",
    ),
)


class QuizScreen(ModalScreen[bool]):
    """A modal with the question, four answers and feedback; escape closes it."""

    BINDINGS = [Binding("escape,t", "dismiss_quiz", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="quiz"):
            yield Static("Quiz", classes="quiz-title")
            yield Static(QUESTION, classes="quiz-question")
            yield OptionList(*(Option(text, id=str(i)) for i, (text, _, _) in enumerate(ANSWERS)))
            yield Static("Pick an answer (↑/↓, enter). Escape closes.", id="feedback")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        _, right, words = ANSWERS[int(event.option.id or 0)]
        feedback = self.query_one("#feedback", Static)
        feedback.set_class(right, "-right")
        feedback.set_class(not right, "-wrong")
        feedback.update(("✓ " if right else "✗ ") + words)

    def action_dismiss_quiz(self) -> None:
        self.dismiss(self.query_one("#feedback").has_class("-right"))
