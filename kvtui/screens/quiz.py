"""Explain it back: a question for each of the lesson's three ideas, then its closing one.

The screen is opaque, so no answer's wording shows behind it, and each answer gets feedback that
explains, in the lesson's terms, why it is right or not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from kvtui.widgets.footer import KeysFooter

SESSION_SEED = random.SystemRandom().randrange(2**32)
"""Orders the answers for this session (one run of kvtui): each session its own order, so the
place of an answer is no tell; a test passes its own seed to reproduce one."""


@dataclass(frozen=True)
class Question:
    node: str
    """Which idea of the lesson it checks."""
    text: str
    answers: tuple[tuple[str, bool, str], ...]
    """(answer, right, feedback) for each choice."""


QUESTIONS: tuple[Question, ...] = (
    Question(
        "1 · Without a cache",
        "Without a cache, the step that emits token 24 after a one-token prompt computes how many "
        "positions, and why?",
        (
            (
                "1: just the new token; the rest is kept.",
                False,
                "That is the cached step. Without a cache nothing of the past is kept, so the "
                "step must rebuild every earlier token's keys and values too.",
            ),
            (
                "24: every position so far, again.",
                True,
                "Right. Each step feeds the whole sequence back in: 1 + 2 + ... + 24 = 300 "
                "positions for 24 tokens, 276 of them recomputed. The total grows with the "
                "square of the length.",
            ),
            (
                "576: every position against every other.",
                False,
                "That counts attention scores, not positions computed. A position is one "
                "token's pass through the model: 24 of them at step 24.",
            ),
        ),
    ),
    Question(
        "2 · With the cache",
        "Why can the cache keep the keys and values of past tokens, but not their queries?",
        (
            (
                "Past keys and values never change; a query is needed only at its own step.",
                True,
                "Right. With causal masking a token's keys and values depend only on the tokens "
                "before it, so they stay valid forever; the query of the new token is used at "
                "its own step and then never again.",
            ),
            (
                "Queries are larger than keys and values: storing them costs too much memory.",
                False,
                "A query is the same size as a key. It is not kept because no later step needs "
                "it: only the new token asks a question.",
            ),
            (
                "Queries change at every step as the context grows, so a kept one goes stale.",
                False,
                "A token's query depends only on the tokens before it, as its key and value do: "
                "it would never change. It is not kept because no later step needs it.",
            ),
        ),
    ),
    Question(
        "3 · The cache eats memory",
        "What sets the size of the KV cache for one sequence?",
        (
            (
                "Tokens x 2 x layers x KV heads x head dim x bytes per element.",
                True,
                "Right. Keys and values (the 2), for every layer and KV head, for every token "
                "held: it grows by the same amount with each token, and again with each "
                "sequence in the batch.",
            ),
            (
                "The parameters, times the bytes of each one, set once at load time.",
                False,
                "That is the weights' size, fixed from token 1. The cache grows with the tokens "
                "held, beside the weights.",
            ),
            (
                "The answer's tokens times the layers: the prompt's are not kept.",
                False,
                "The prompt's tokens are cached too: every position held counts, prompt and "
                "answer alike.",
            ),
        ),
    ),
    Question(
        "The closing question",
        "A model has plenty of compute left, but a long chat suddenly refuses to continue. Why, "
        "and what actually ran out?",
        (
            (
                "Compute: attention over a long chat needs more FLOPs than the GPU has.",
                False,
                "Not quite: a decode step does about 2 FLOPs per parameter plus a little "
                "attention, far below the GPU's peak. Compute was left over; something else "
                "filled up.",
            ),
            (
                "GPU memory: the KV cache grew with every token and ran out of room.",
                True,
                "Right. Every token keeps its keys and values in every layer; past the memory "
                "left after the weights, the next token has nowhere to go. Shorter context, "
                "smaller batch, a smaller KV dtype or a bigger GPU are the ways out.",
            ),
            (
                "The weights: they grew with every token until they filled the GPU.",
                False,
                "No: the weights are the same size at token 1 and token 100,000. What grows is "
                "the cache of keys and values, one entry per token per layer.",
            ),
            (
                "Its context: the model forgot the start of the chat, so it had to stop.",
                False,
                "Forgetting is a different limit (the model's trained context). The refusal "
                "here is physical: the KV cache no longer fits in memory.",
            ),
        ),
    ),
)


class QuizScreen(Screen[int]):
    """The questions one at a time; `n` moves on; escape closes and returns how many were right.

    An opaque screen of its own: nothing of the lesson's screens, answers included, shows
    behind it."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("n", "next", "Next question"),
    ]

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = SESSION_SEED if seed is None else seed
        """Orders each question's answers (`answers`): the same seed, the same order; the
        session's by default."""
        self.index = 0
        self.right: set[int] = set()

    def answers(self, index: int | None = None) -> list[tuple[str, bool, str]]:
        """The answers of question `index` (the one shown by default) in the order shown:
        shuffled by the seed, so that the right one is not always first."""
        index = self.index if index is None else index
        shown = list(QUESTIONS[index].answers)
        random.Random(f"{self.seed}:{index}").shuffle(shown)
        return shown

    def compose(self) -> ComposeResult:
        with Vertical(id="quiz"):
            yield Static("", classes="quiz-title")
            yield Static("", classes="quiz-question")
            yield OptionList()
            yield Static("", id="feedback")
        yield KeysFooter(show_command_palette=False, compact=True)  # whole at 80 columns

    def on_mount(self) -> None:
        self.show_question()

    def show_question(self) -> None:
        question = QUESTIONS[self.index]
        self.query_one(".quiz-title", Static).update(
            f"Explain it back · {self.index + 1} of {len(QUESTIONS)} · {question.node}"
        )
        self.query_one(".quiz-question", Static).update(question.text)
        options = self.query_one(OptionList)
        options.clear_options()
        options.add_options(
            Option(text, id=str(i)) for i, (text, _, _) in enumerate(self.answers())
        )
        options.highlighted = None  # enter alone picks nothing: ↓ first, to the first answer
        options.focus()
        feedback = self.query_one("#feedback", Static)
        feedback.remove_class("-right", "-wrong")
        feedback.update("Pick an answer (↑/↓, enter). n: next question. Escape closes.")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        _, right, words = self.answers()[int(event.option.id or 0)]
        if right:
            self.right.add(self.index)
        feedback = self.query_one("#feedback", Static)
        feedback.set_class(right, "-right")
        feedback.set_class(not right, "-wrong")
        more = " n: next question." if self.index + 1 < len(QUESTIONS) else " Escape closes."
        mark = "[$text-success]✓[/] " if right else "✗ "  # green as a mark, text as text
        feedback.update(Content.from_markup(mark) + Content(words + more))

    def action_next(self) -> None:
        if self.index + 1 < len(QUESTIONS):
            self.index += 1
            self.show_question()

    def action_close(self) -> None:
        self.dismiss(len(self.right))
