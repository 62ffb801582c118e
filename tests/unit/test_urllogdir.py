"""The URL logdir's syncer and checks (psflow.launch.urllogdir), on fsspec's in-memory filesystem."""

from __future__ import annotations

import uuid

import fsspec
import pytest

from psflow.errors import ConfigError
from psflow.launch import urllogdir
from psflow.launch.urllogdir import LogdirSyncer


@pytest.fixture
def url():
    return f"memory://runs-{uuid.uuid4().hex[:8]}/run"


def remote(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root)}


def staged(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker-0.log").write_text("line 1\n")
    (tmp_path / "status.json").write_text('{"state": "running"}')
    (tmp_path / ".secret").write_text("s3cr3t")
    (tmp_path / ".status.json.1.2.tmp").write_text("{")
    return tmp_path


def test_a_pass_uploads_what_changed_never_the_secret_nor_a_temporary_file_and_holds_done_back(tmp_path, url):
    local = staged(tmp_path)
    (local / "DONE").write_text("")
    s = LogdirSyncer(local, url)
    assert s.sync_once(final=False) == ["logs/worker-0.log", "status.json"]
    assert remote(url) == {"logs/worker-0.log": b"line 1\n", "status.json": b'{"state": "running"}'}
    assert s.sync_once(final=False) == []  # nothing changed
    with (local / "logs" / "worker-0.log").open("a") as f:
        f.write("line 2\n")
    assert s.sync_once(final=False) == ["logs/worker-0.log"]
    assert remote(url)["logs/worker-0.log"] == b"line 1\nline 2\n"  # whole, never torn


def test_the_final_pass_publishes_done_last(tmp_path, url):
    local = staged(tmp_path)
    s = LogdirSyncer(local, url)
    s.sync_once(final=False)
    (local / "summary.json").write_text("{}")
    (local / "DONE").write_text("")
    (local / "status.json").write_text('{"state": "succeeded"}')
    assert s.sync_once(final=True) == ["status.json", "summary.json", "DONE"]
    assert set(remote(url)) == {"logs/worker-0.log", "status.json", "summary.json", "DONE"}


def test_done_is_not_published_while_another_file_failed_and_the_final_pass_says_so(tmp_path, url, monkeypatch):
    local = staged(tmp_path)
    (local / "DONE").write_text("")
    s = LogdirSyncer(local, url)
    warned = []
    s.warn = warned.append
    real = s._fs.pipe_file

    def refuse_the_status(path, data, **kw):
        if path.endswith("status.json"):
            raise PermissionError("access denied")
        return real(path, data, **kw)

    monkeypatch.setattr(s._fs, "pipe_file", refuse_the_status)
    with pytest.raises(ConfigError, match=r"status.json \(PermissionError: access denied\).*copy them up by hand"):
        s.sync_once(final=True)
    assert "DONE" not in remote(url) and "logs/worker-0.log" in remote(url)
    assert len(warned) == 1 and "could not upload status.json" in warned[0]


def test_close_stops_the_thread_and_uploads_everything(tmp_path, url):
    local = staged(tmp_path)
    with LogdirSyncer(local, url, interval_s=3600):
        (local / "DONE").write_text("")
    assert set(remote(url)) == {"logs/worker-0.log", "status.json", "DONE"}


def test_check_url_writes_and_removes_a_probe_and_names_an_unknown_scheme(url):
    urllogdir.check_url(url)
    assert remote(url) == {}
    with pytest.raises(ConfigError, match=r"--logdir 'nosuchscheme://b/run' cannot be used"):
        urllogdir.check_url("nosuchscheme://b/run")


def test_staging_dirs_are_fresh_private_and_named_after_the_url(tmp_path):
    a = urllogdir.staging_dir("s3://bucket/exp 1/", tmp_path)
    b = urllogdir.staging_dir("s3://bucket/exp 1/", tmp_path)
    assert a != b and a.parent == tmp_path / "staging" and a.name.startswith("exp-1-")
    assert a.stat().st_mode & 0o777 == 0o700
    assert urllogdir.checkpoint_url("s3://b/run/") == "s3://b/run/checkpoints"
    assert urllogdir.is_url("s3://b/run") and not urllogdir.is_url("runs/a") and not urllogdir.is_url(None)
