"""Component tests: a PS_INIT or PS_REPLICATE is bounded by what the shard holds before its bytes are received.

The ps is a real Server + PsService on 127.0.0.1 (tests/component/inproc.py); the hostile client
holds the job's secret, names itself as the task the ps expects (the chief for a PS_INIT, the other
ps of the shard's pair for a PS_REPLICATE) and speaks the frame format by hand
(tests/component/test_push_bounds.py's helpers). What is proven: a PS_INIT that declares 2 GiB for a
7,850-float shard is refused at once, before its payload, with an ERROR naming the tensor, the bytes
declared and what the shard holds, and the process does not grow while the client streams 256 MiB;
a PS_INIT whose tensors are not the shard's (a wrong shape or dtype, a key it does not hold, a slot
no optimizer keeps, a value missing) is refused the same way, before the shard is initialized (by
the placement the request declares) and after (by its values); a PS_REPLICATE ``init``, ``state``
or ``batch`` the same against the backup copy's shard, and a batch of an older term for a restarted
ps's empty copy as stale (the kind its handler gives). Each time the shard's values are unchanged and
the ps keeps serving the job.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from inproc import SECRET, InprocCluster
from replicated import batch_for, make_model
from test_push_bounds import GIB2, KEY_FLOATS, Flat, declare_and_stream, error_of, hostile, rss_kib, step

from psflow import optim
from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.ps.placement import ParamInfo, place
from psflow.wire.conn import connect
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)

WAIT_S = 30.0
SIZES = {"float32": 4, "float64": 8}


def init_meta(placement: bool = True) -> dict:
    """A PS_INIT's meta as the chief's trainer sends it for Flat on one ps (``placement``: with its placement)."""
    meta = {"optimizer": optim.SGD(lr=0.01).to_dict(), "config": TrainConfig().to_dict(), "version": 0}
    if placement:
        meta["meta"] = {"placement": place([ParamInfo("w", (KEY_FLOATS,))], 1).to_dict()}
    return meta


def payload_of(tensors: list) -> int:
    return sum(SIZES[dtype] * torch.Size(shape).numel() for _, dtype, shape in tensors)


def test_a_ps_init_declaring_2_gib_for_a_7850_float_shard_is_refused_before_its_bytes_and_the_shard_is_untouched() -> None:
    with InprocCluster(1, 2, TrainConfig()) as c:
        service = c.services[0]
        conn = hostile(c, "worker:0")  # the chief: the one task a PS_INIT is taken from
        try:
            before = rss_kib()
            sent, answered_s, received = declare_and_stream(
                conn, [["w", "float32", [GIB2 // 4]]], init_meta(), GIB2, 256 << 20, op=Op.PS_INIT)
            growth_mib = (rss_kib() - before) / 1024
        finally:
            conn.close()
        print(f"refused {answered_s * 1000:.0f} ms after the head; RSS growth {growth_mib:.1f} MiB; {sent >> 20} MiB streamed")
        assert growth_mib < 100, f"the process grew by {growth_mib:.0f} MiB while the client streamed {sent >> 20} MiB"
        error = error_of(received)
        assert (f"PS_INIT from worker:0 refused: tensor 'w' (float32 [{GIB2 // 4}], {GIB2} bytes) does not fit: shard 0 "
                f"holds 'w' as float32 [{KEY_FLOATS}] ({4 * KEY_FLOATS} bytes) by the request's placement") in error, error
        assert "Refused before its payload was received" in error, error
        assert not service.store.initialized and service.store.stats.init_requests == 0  # untouched
        trainer = c.trainer(0, Flat(), optim.SGD(lr=0.01))
        trainer.prepare()  # the real chief initializes it
        step(trainer)
        assert service.store.stats.applied_updates == 1 and service.store.stats.init_requests == 1


@pytest.mark.parametrize("meta, tensors, what", [
    (init_meta(), [["w", "float32", [KEY_FLOATS + 1]]],
     f"tensor 'w' (float32 [{KEY_FLOATS + 1}], {4 * KEY_FLOATS + 4} bytes) does not fit: shard 0 holds 'w' as float32 "
     f"[{KEY_FLOATS}] ({4 * KEY_FLOATS} bytes) by the request's placement"),
    (init_meta(), [["w", "float32", [KEY_FLOATS]], ["b", "float32", [10]]],
     "tensor 'b' (float32 [10], 40 bytes) is none of the keys shard 0 holds by the request's placement (w)"),
    (init_meta(placement=False), [["w", "float32", [KEY_FLOATS]]], "declares no placement (meta.placement)"),
])
def test_a_ps_init_that_is_not_the_shard_its_placement_declares_is_refused_before_the_shard_is_initialized(
        meta: dict, tensors: list, what: str) -> None:
    with InprocCluster(1, 2, TrainConfig()) as c:
        conn = hostile(c, "worker:0")
        try:
            _, _, received = declare_and_stream(conn, tensors, meta, payload_of(tensors), payload_of(tensors), op=Op.PS_INIT)
        finally:
            conn.close()
        assert what in error_of(received), error_of(received)
        assert not c.services[0].store.initialized
        trainer = c.trainer(0, Flat(), optim.SGD(lr=0.01))
        trainer.prepare()
        step(trainer)
        assert c.services[0].store.stats.applied_updates == 1


@pytest.mark.parametrize("sender, tensors, what", [
    ("worker:0", [["w", "float64", [KEY_FLOATS]]],
     f"tensor 'w' (float64 [{KEY_FLOATS}], {8 * KEY_FLOATS} bytes) does not fit: shard 0 holds 'w' as float32 "
     f"[{KEY_FLOATS}] ({4 * KEY_FLOATS} bytes) now"),
    ("worker:0", [["w", "float32", [KEY_FLOATS]], ["opt/w/momentum_buffer", "float32", [8 * KEY_FLOATS]]],
     f"tensor 'opt/w/momentum_buffer' (float32 [{8 * KEY_FLOATS}], {32 * KEY_FLOATS} bytes) does not fit"),
    ("worker:0", [["w", "float32", [KEY_FLOATS]], ["opt/w/stash", "float32", [KEY_FLOATS]]],
     "is slot 'stash', which no psflow optimizer keeps"),
    ("worker:0", [["ema/w", "float32", [KEY_FLOATS]]], "it lacks 1 of the values shard 0 holds now (w)"),
    ("worker:1", [["w", "float32", [KEY_FLOATS]]], "PS_INIT from worker:1 refused: only the chief (worker:0) sends it"),
])
def test_a_ps_init_whose_tensors_do_not_fit_the_shard_is_refused_naming_them_and_changes_nothing(
        sender: str, tensors: list, what: str) -> None:
    with InprocCluster(1, 2, TrainConfig()) as c:
        trainer = c.trainer(0, Flat(), optim.SGD(lr=0.01))
        trainer.prepare()
        step(trainer)
        store = c.services[0].store
        values, inits = store.values["w"].clone(), store.stats.init_requests
        conn = hostile(c, sender)
        try:
            _, _, received = declare_and_stream(conn, tensors, init_meta(), payload_of(tensors), payload_of(tensors),
                                                op=Op.PS_INIT)
        finally:
            conn.close()
        error = error_of(received)
        assert what in error and "Refused before its payload was received" in error, error
        assert torch.equal(store.values["w"], values) and store.stats.init_requests == inits  # nothing changed
        step(trainer)  # the ps still serves the job
        assert store.stats.applied_updates == 2


def _bad_replicate(kind: str, key: str, value: torch.Tensor, term: int) -> tuple[dict, list, str]:
    """A PS_REPLICATE of ``kind`` for shard 0 whose tensors do not fit its copy; the error it gets."""
    shape, n = list(value.shape), value.numel()
    big = [key, "float32", [n * 4096]]  # 4096 times the value's size
    holds = f"shard 0 holds {key!r} as float32 {shape} ({4 * n} bytes) now"
    if kind == "batch-shape":
        return ({"kind": "batch", "shard": 0, "term": term, "events": [{}], "last_seq": 1}, [[f"9/{key}", "float32", [n + 1]]],
                f"update '9/{key}' (float32 [{n + 1}], {4 * n + 4} bytes) does not fit: {holds}")
    if kind == "batch-versions":
        return ({"kind": "batch", "shard": 0, "term": term, "events": [{}], "last_seq": 1},
                [[f"9/{key}", "float32", shape], [f"10/{key}", "float32", shape]],
                "it carries updates of more versions than its 1 event(s)")
    return ({"kind": kind, "shard": 0, "term": term, "meta": {}, "progress": {"held": {}}}, [big],
            f"tensor {key!r} (float32 [{n * 4096}], {16384 * n} bytes) does not fit: {holds}")


@pytest.mark.parametrize("kind", ["batch-shape", "batch-versions", "state", "init"])
def test_a_ps_replicate_whose_tensors_do_not_fit_the_copy_is_refused_and_the_backup_is_unchanged(kind: str) -> None:
    with InprocCluster(2, 1, TrainConfig(mode="async", ps_replicas=2)) as c:
        model = make_model()
        t = c.trainer(0, model, optim.SGD(lr=0.1))
        t.prepare()
        x, y = batch_for(0)
        t.step(lambda: F.cross_entropy(model(x), y))
        c.settle()
        backup = c.services[1].backups[0]  # shard 0's copy on ps:1; ps:0 serves it and alone sends its records
        before, seq = {k: v.clone() for k, v in backup.values.items()}, backup.seq
        key, value = sorted(backup.values.items())[0]
        meta, tensors, what = _bad_replicate(kind, key, value, c.services[1].views[0].term)
        conn = connect(c.cluster.address(TaskId("ps", 1)), secret=SECRET, task="ps:0", peer="ps:1", deadline_s=WAIT_S)
        try:
            payload = payload_of(tensors)
            _, _, received = declare_and_stream(conn, tensors, meta, payload, min(payload, 16 << 20), op=Op.PS_REPLICATE)
        finally:
            conn.close()
        error = error_of(received)
        assert f"PS_REPLICATE {meta['kind']!r} from ps:0 for shard 0 refused: " in error and what in error, error
        assert backup.seq == seq and all(torch.equal(backup.values[k], v) for k, v in before.items())  # unchanged
        assert c.services[1].backups[0] is backup
        t.step(lambda: F.cross_entropy(model(x), y))  # replication goes on: the backup follows its primary
        c.settle()
        assert backup.version == c.services[0].store.version == 2
        assert all(torch.equal(backup.values[k], v) for k, v in c.services[0].store.values.items())


def test_a_batch_of_an_older_term_for_a_copy_not_loaded_yet_is_refused_as_stale_before_its_bytes() -> None:
    """A restarted ps holds its copies empty until it re-syncs: a batch for one is refused on its head
    (its tensors not received), as stale when its term is older than the ps's view (kind StaleTermError,
    as the handler answers it: a serving copy that sent it asks for the new view)."""
    from psflow.wire.frame import HEADER_SIZE, Limits, decode_header, decode_meta

    with InprocCluster(2, 1, TrainConfig(mode="async", ps_replicas=2, primary_failover_s=1.0, backup_failover_s=1.0)) as c:
        model = make_model()
        t = c.trainer(0, model, optim.SGD(lr=0.1))
        t.prepare()
        x, y = batch_for(0)
        t.step(lambda: F.cross_entropy(model(x), y))
        key = sorted(c.services[0].store.values)[0]
        c.services[0].partition()  # ps:0 sends no ps its state until healed: ps:1's copies stay empty meanwhile
        c.kill_ps(1)
        restarted = c.restart_ps(1)  # the authority moved shard 0's view past term 0 when ps:1 went down
        conn = connect(c.cluster.address(TaskId("ps", 1)), secret=SECRET, task="ps:0", peer="ps:1", deadline_s=WAIT_S)
        declared = 64 << 20
        try:
            _, _, received = declare_and_stream(
                conn, [[f"1/{key}", "float32", [declared // 4]]], {"kind": "batch", "shard": 0, "term": 0, "events": [{}]},
                declared, 16 << 20, op=Op.PS_REPLICATE)
        finally:
            conn.close()
        op, _, meta_len, _ = decode_header(received[:HEADER_SIZE], Limits())
        reply = decode_meta(received[HEADER_SIZE:HEADER_SIZE + meta_len], 0, Limits())[0]
        assert op == Op.ERROR and reply["kind"] == "StaleTermError", reply
        assert "ps:1 refuses ps:0's batch of shard 0 in term 0" in reply["error"], reply
        assert not restarted.backups[0].initialized
        c.services[0].partition()  # healed
        restarted.resync(30.0)  # the ps goes on: it loads its copies from the serving ps
        t.step(lambda: F.cross_entropy(model(x), y))
        c.settle()
        assert restarted.backups[0].version == c.services[0].store.version == 2
