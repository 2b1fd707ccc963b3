"""The command palette (ctrl+p): kvtui's guarded palette for every search the App opens, its
entries (restart with another engine; screen 3's what-if model and GPU), and where the palette's
Screenshot goes.

`PaletteApp` is the App's palette side, which the App (kvtui.app.KVApp) builds on; screen 3 lists
`BudgetCommands` among its own COMMANDS."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol, runtime_checkable

from textual.app import App
from textual.command import CommandListItem, DiscoveryHit, Hit, Hits, Provider, SimpleProvider
from textual.theme import ThemeProvider
from textual.widget import AwaitMount

from kvtui.sim.catalog import gpu_names, model_names
from kvtui.terminal import CommandPalette


@runtime_checkable
class Restarts(Protocol):
    """An app that can restart its run with another engine (kvtui.app.KVApp)."""

    def restart_with(self, engine: str) -> None: ...


class EngineCommands(Provider):
    """Command palette entries: restart with another engine."""

    def _commands(self) -> list[tuple[str, Callable[[], None], str]]:
        app = self.app
        assert isinstance(app, Restarts)
        commands: list[tuple[str, Callable[[], None], str]] = [
            ("Engine: tiny", partial(app.restart_with, "tiny"), "the shipped model, real torch")
        ]
        for name in model_names():
            commands.append(
                (
                    f"Engine: sim:{name}@h100",
                    partial(app.restart_with, f"sim:{name}@h100"),
                    "roofline-timed steps, no torch",
                )
            )
        for name in model_names():
            commands.append(
                (
                    f"Engine: shape:{name}",
                    partial(app.restart_with, f"shape:{name}"),
                    "the model's real shape, random weights",
                )
            )
        return commands

    async def discover(self) -> Hits:
        for text, command, help_text in self._commands():
            if text.startswith(("Engine: tiny", "Engine: sim:llama-3.1-8b")):
                yield DiscoveryHit(text, command, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, command, help_text in self._commands():
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), command, help=help_text)


@runtime_checkable
class ChoosesWhatIf(Protocol):
    """A screen whose what-if's model and GPU can be chosen (kvtui.screens.memory.MemoryScreen)."""

    def choose(self, *, model: str | None = None, gpu: str | None = None) -> None: ...


class BudgetCommands(Provider):
    """Command palette entries on screen 3: the what-if's model and GPU."""

    def _commands(self) -> list[tuple[str, Callable[[], None]]]:
        screen = self.screen
        assert isinstance(screen, ChoosesWhatIf)
        return [
            *((f"Model: {n}", partial(screen.choose, model=n)) for n in model_names()),
            *((f"GPU: {n}", partial(screen.choose, gpu=n)) for n in gpu_names()),
        ]

    async def discover(self) -> Hits:
        for text, command in self._commands():
            yield DiscoveryHit(text, command, help="screen 3's what-if")

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, command in self._commands():
            if (score := matcher.match(text)) > 0:
                yield Hit(score, matcher.highlight(text), command, help="screen 3's what-if")


class PaletteApp(App[int]):
    """An App whose command palette is kvtui's (kvtui.terminal.CommandPalette) wherever Textual
    opens one (ctrl+p, its Theme command, `search_commands`), with the engine commands."""

    COMMANDS = App.COMMANDS | {EngineCommands}

    def action_command_palette(self) -> None:
        # No id, where Textual gives it "--command-palette": ctrl+p again while the last one
        # is still being removed made a second node of that id (DuplicateIds, in the sweep).
        if self.use_command_palette and not CommandPalette.is_open(self):
            self.push_screen(CommandPalette())

    def search_themes(self) -> None:  # the palette's "Theme" command: kvtui's palette too
        self.push_screen(
            CommandPalette(providers=[ThemeProvider], placeholder="Search for themes…")
        )

    def search_commands(
        self, commands: Sequence[CommandListItem], placeholder: str = "Search for commands…"
    ) -> AwaitMount:
        return self.push_screen(
            CommandPalette(
                providers=[SimpleProvider(self.screen, commands)], placeholder=placeholder
            )
        )

    def deliver_screenshot(
        self, filename: str | None = None, path: str | None = None, time_format: str | None = None
    ) -> str | None:
        """The palette's Screenshot: into ~/Downloads where there is one (Textual's choice),
        else the current folder. Textual assumed the Downloads folder exists, and on a server
        without one said only "Failed to save screenshot"."""
        if path is None:
            downloads = Path.home() / "Downloads"
            path = str(downloads if downloads.is_dir() else Path.cwd())
        return super().deliver_screenshot(filename, path, time_format)
