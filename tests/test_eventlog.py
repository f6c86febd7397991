"""metrics.jsonl's writer when the disk refuses its writes (without filling a disk)."""

import errno
import logging
import os

from omnips import eventlog
from omnips.eventlog import EventLog
from omnips.metrics import read_events


class Disk:
    """os.write with room for `room` more bytes (None: any), as a full disk answers beyond it."""

    def __init__(self, monkeypatch, room=None):
        self.room, self._write = room, os.write
        monkeypatch.setattr(eventlog.os, "write", self.write)

    def write(self, fd, data):
        if self.room is None:
            return self._write(fd, data)
        if self.room == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self._write(fd, bytes(data[:self.room]))
        self.room -= n
        return n


def line(i: int) -> str:
    return f'{{"event": "step", "t": {i}}}'


def test_events_wait_while_the_disk_is_full_and_are_written_in_order_once_it_has_room(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    disk = Disk(monkeypatch, room=50)  # 50 bytes: one line and a part of the next
    log = EventLog(tmp_path / "metrics.jsonl", new=True, batch=1)
    for i in range(5):
        log.append(line(i))
    log.flush()
    assert log.failure is not None and log.lost == 4  # the second line is written in part
    disk.room = None
    log.flush()
    log.close()
    assert [e["t"] for e in read_events(tmp_path)] == list(range(5))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "No space left on device" in said[0] and "written again" in said[1], said


def test_a_line_written_in_part_is_cut_off_at_close(tmp_path, monkeypatch, caplog):
    Disk(monkeypatch, room=50)
    log = EventLog(tmp_path / "metrics.jsonl", new=True, batch=1)
    for i in range(3):
        log.append(line(i))
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == line(0) + "\n"
    assert "2 events could not be written" in caplog.records[-1].getMessage()


def test_events_beyond_what_may_wait_are_dropped_and_counted(tmp_path, monkeypatch):
    disk = Disk(monkeypatch, room=0)
    log = EventLog(tmp_path / "metrics.jsonl", new=True, held_max=4 * len(line(0) + "\n"), batch=1)
    for i in range(10):
        log.append(line(i))
    assert log.dropped == 6 and log.lost == 10  # 4 lines wait
    disk.room = None
    log.close()
    assert [e["t"] for e in read_events(tmp_path)] == list(range(4))
    assert log.lost == 6
