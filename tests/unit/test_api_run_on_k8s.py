"""A run started through the platform (the dashboard's and `psflow restart`'s `run_here`) runs the plan
as its backend runs it: on Kubernetes without the hang watchdog (pods send the launcher no heartbeats),
as `psflow run --backend k8s` does. The run goes through the fake Kubernetes cluster (tests/unit/k8s_fake.py)."""

from __future__ import annotations

import pytest
from k8s_fake import FakeCluster

import psflow.launch.assemble as assemble
from psflow.launch.k8s import K8sSettings
from psflow.launch.k8swatch import K8sBackend
from psflow.platform.launching import LaunchSpec, run_here


def test_a_platform_run_on_kubernetes_runs_without_the_hang_watchdog(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PSFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import psflow\n")
    said: list[str] = []
    cluster = FakeCluster()

    def fake_backend(options: assemble.BackendOptions) -> K8sBackend:
        assert options.name == "k8s"
        return K8sBackend(K8sSettings(image="train:1", volume_claim="psflow-logs"), core=cluster.core, batch=cluster.batch,
                          policy=cluster.policy, poll_s=0.001, echo=said.append)

    monkeypatch.setattr(assemble, "make_backend", fake_backend)
    spec = LaunchSpec(script="train.py", num_ps=1, num_workers=2, backend="k8s", hangs={"hang_timeout_s": 30.0},
                      k8s={"image": "train:1", "volume_claim": "psflow-logs"}, logdir="runs/k8s-run")
    plan, result = run_here(spec, runs_root=tmp_path / "runs")
    assert result.exit_code == 0, result.summary
    assert not plan.hangs.enabled, plan.hangs  # the plan as run: the watchdog's deadline dropped
    assert any("--hang-timeout is not applied on Kubernetes" in line for line in said), said


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
