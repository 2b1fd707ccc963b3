"""The engine child's events on its stdout: steps go out in batches, anything else at once."""

import json
import os
import select

from kvtui.engines.drive import EventWriter
from kvtui.engines.protocol import RunProgress, StepSample, event_from_json


def step(i: int) -> StepSample:
    return StepSample("cached", i, 1 + i, 0, "x", 1, 1, 1, 0.001, 0)


def lines_within(fd: int, seconds: float) -> list[dict]:
    """The JSON lines readable from `fd` within `seconds` (none if nothing comes)."""
    data = b""
    while select.select([fd], [], [], seconds)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
        seconds = 0.05  # what was flushed together arrives together
    return [json.loads(line) for line in data.decode().splitlines()]


def pipe_writer(every: float) -> tuple[EventWriter, int]:
    read, write = os.pipe()
    return EventWriter(os.fdopen(write, "wb"), every=every), read


def test_steps_wait_for_the_next_flush_and_other_events_take_them_along():
    writer, fd = pipe_writer(every=3600.0)  # the flusher's first flush, then none for an hour
    writer.write(step(0))
    assert [event_from_json(e) for e in lines_within(fd, 5.0)] == [step(0)]
    writer.write(step(1))
    writer.write(step(2))
    assert lines_within(fd, 0.2) == []  # held: the flusher is waiting out its hour
    writer.write(RunProgress("loading"))  # not a step: flushed at once, with what waited
    got = [event_from_json(e) for e in lines_within(fd, 5.0)]
    assert got == [step(1), step(2), RunProgress("loading")]
    writer.write(step(3))
    writer.close()  # nothing is left behind
    assert [event_from_json(e) for e in lines_within(fd, 5.0)] == [step(3)]


def test_a_step_goes_out_without_another_event_to_push_it():
    writer, fd = pipe_writer(every=0.01)
    for i in range(3):
        writer.write(step(i))
        assert [event_from_json(e) for e in lines_within(fd, 5.0)] == [step(i)]
    writer.close()


def test_a_writer_whose_reader_is_gone_closes_quietly():
    writer, fd = pipe_writer(every=0.01)
    os.close(fd)
    writer.write(step(0))  # buffered; the flusher's write fails and it stops
    writer.close()
