"""Test-only plugin for `grpokit rollout --external_plugins`: breaks one weight sync on the receiving side.

The file named by ``GRPOKIT_TEST_SYNC_FAULT_FILE`` says what to break, read when a trainer's sync group sends its
first update (so that one server serves several runs, each with its own fault): ``corrupt:B:N`` adds 0.5 to the
first element of bucket B's first tensor on the group's N-th sync (counting from 1), after the bytes arrived and
before they are loaded; ``drop:B:N`` does not load bucket B at all on that sync; ``none`` breaks nothing.
Production code has no branch for it: this file wraps ``WeightReceiver.receive`` when it is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

from grpokit.server.weight_sync import WeightReceiver

_receive = WeightReceiver.receive
_groups: dict[str, list] = {}  # group -> [syncs so far, mode, bucket, at]


def _faulty_receive(self, body, load):
    if self.group not in _groups:
        spec = Path(os.environ["GRPOKIT_TEST_SYNC_FAULT_FILE"]).read_text().strip()
        mode, bucket, at = (spec.split(":") + ["0", "0"])[:3] if spec != "none" else ("none", "0", "0")
        _groups[self.group] = [0, mode, int(bucket), int(at)]
    fault = _groups[self.group]
    fault[0] += 1
    if fault[1] == "none" or fault[0] != fault[3]:
        return _receive(self, body, load)
    seen = [0]

    def broken_load(named):
        index, seen[0] = seen[0], seen[0] + 1
        if index != fault[2]:
            return load(named)
        if fault[1] == "drop":
            return None
        name, tensor = named[0]
        tensor = tensor.clone()
        tensor.view(-1)[0] += 0.5
        return load([(name, tensor), *named[1:]])

    return _receive(self, body, broken_load)


WeightReceiver.receive = _faulty_receive
