"""The title card a launch draws before the app, kept for the next launch at that size
(kvtui.bigtext.kept_title_card): the same lines as drawn, without loading pyfiglet's fonts, and a
kept file checked as any file from outside is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtui.bigtext import KEPT_CARDS, kept_title_card, title_card

KEPT = """
import json, sys
from pathlib import Path
from kvtui.bigtext import kept_title_card
card = kept_title_card(80, 24, Path(sys.argv[1]))
print(json.dumps({"card": [[line.text, line.kind] for line in card],
                  "fonts": "pyfiglet" in sys.modules}))
"""


def _launch(folder) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", KEPT, str(folder)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _lines(card) -> list[list[str]]:
    return [[line.text, line.kind] for line in card]


def test_the_second_launch_at_a_size_draws_the_card_the_first_drew_without_its_fonts(tmp_path):
    first, second = _launch(tmp_path), _launch(tmp_path)
    assert first["fonts"] and not second["fonts"]
    assert first["card"] == second["card"] == _lines(title_card(80, 24))
    assert [p.name for p in tmp_path.iterdir()] == ["title-cards.json"]  # no .part left


@pytest.mark.parametrize(
    "kept",
    [
        "not json {",
        "\xff\xfe".encode("latin-1").decode("latin-1"),
        json.dumps([1, 2, 3]),
        json.dumps({"key": "another version", "cards": {}}),
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_a_kept_file_that_is_not_kvtuis_is_drawn_over(tmp_path, kept):
    (tmp_path / "title-cards.json").write_text(kept, encoding="latin-1")
    assert _lines(kept_title_card(80, 24, tmp_path)) == _lines(title_card(80, 24))
    assert "80x24" in json.loads((tmp_path / "title-cards.json").read_text())["cards"]


@pytest.mark.parametrize(
    "line",
    [
        ["\x1b[31mkvtui\x1b[0m", "title"],  # an escape sequence for the terminal
        ["x" * 81, "idea"],  # wider than the terminal
        ["kvtui", "shell"],  # no kind of line a card has
        ["kvtui"],
        [42, "title"],
    ],
)
def test_a_kept_card_with_a_line_kvtui_would_not_draw_is_drawn_afresh(tmp_path, line):
    kept_title_card(80, 24, tmp_path)  # kept, with this module's key
    path = tmp_path / "title-cards.json"
    kept = json.loads(path.read_text())
    kept["cards"]["80x24"][3] = line
    path.write_text(json.dumps(kept))
    assert _lines(kept_title_card(80, 24, tmp_path)) == _lines(title_card(80, 24))


def test_a_kept_file_too_large_is_not_read(tmp_path):
    kept_title_card(80, 24, tmp_path)
    path = tmp_path / "title-cards.json"
    kept = json.loads(path.read_text())
    kept["cards"]["80x24"] = [["k", "title"]]
    path.write_text(json.dumps(kept) + " " * (1 << 20))
    assert _lines(kept_title_card(80, 24, tmp_path)) == _lines(title_card(80, 24))


def test_a_fifo_where_the_file_would_be_is_not_read(tmp_path):
    os.mkfifo(tmp_path / "title-cards.json")  # reading it would wait for a writer, for ever
    assert _lines(kept_title_card(80, 24, tmp_path)) == _lines(title_card(80, 24))


def test_where_nothing_can_be_kept_the_card_is_drawn(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert _lines(kept_title_card(80, 24, not_a_folder)) == _lines(title_card(80, 24))
    (tmp_path / "cards").mkdir()
    (tmp_path / "cards" / "title-cards.json").mkdir()  # a folder where the file would be
    assert _lines(kept_title_card(100, 30, tmp_path / "cards")) == _lines(title_card(100, 30))
    assert [p.name for p in (tmp_path / "cards").iterdir()] == ["title-cards.json"]


def test_the_sizes_drawn_last_are_kept_and_no_more(tmp_path):
    for width in range(40, 40 + KEPT_CARDS + 5):
        kept_title_card(width, 24, tmp_path)
    cards = json.loads((tmp_path / "title-cards.json").read_text())["cards"]
    assert len(cards) == KEPT_CARDS
    assert "40x24" not in cards and f"{40 + KEPT_CARDS + 4}x24" in cards
