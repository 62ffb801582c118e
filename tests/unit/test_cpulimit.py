"""psflow.cpulimit: a container's CPU limit from its cgroup files (v2 cpu.max, v1 CFS quota), read
through a fake file system: pure parsing, no /sys needed."""

from __future__ import annotations

import pytest

from psflow.cpulimit import cgroup_cpu_limit, container_cpus, cpus_from_limit, parse_cfs_quota, parse_cpu_max

# /proc/self/mountinfo lines as a cgroup v2 host, a hybrid (v1 + unified) host and a container show them.
V2_MOUNT = "30 24 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
HYBRID_MOUNTS = "\n".join([
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755",
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct",
    "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset",
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw",
])
POD = "/kubepods/burstable/pod1234/abcd"


@pytest.mark.parametrize(("text", "cpus"), [("200000 100000", 2.0), ("150000 100000\n", 1.5), ("50000 100000", 0.5),
                                            ("max 100000", None), ("", None), ("garbage", None), ("300000", 3.0)])
def test_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize(("quota", "period", "cpus"), [("400000", "100000", 4.0), ("-1", "100000", None),
                                                       ("50000", "0", None), ("", "", None)])
def test_cfs_quota(quota: str, period: str, cpus: float | None) -> None:
    assert parse_cfs_quota(quota, period) == cpus


def test_v2_a_pods_container_limit_in_its_own_namespaced_cgroup() -> None:
    files = {"/sys/fs/cgroup/cpu.max": "250000 100000\n"}
    assert cgroup_cpu_limit("0::/\n", V2_MOUNT, files.get) == 2.5


def test_v2_without_a_cgroup_namespace_the_smallest_limit_of_the_cgroup_and_its_ancestors() -> None:
    files = {f"/sys/fs/cgroup{POD}/cpu.max": "max 100000", "/sys/fs/cgroup/kubepods/burstable/pod1234/cpu.max": "300000 100000",
             "/sys/fs/cgroup/kubepods/cpu.max": "800000 100000"}
    assert cgroup_cpu_limit(f"0::{POD}\n", V2_MOUNT, files.get) == 3.0
    assert cgroup_cpu_limit(f"0::{POD}\n", V2_MOUNT, {}.get) is None  # no files: no limit


def test_v1_quota_in_the_cpu_hierarchy_and_a_container_whose_mount_root_is_its_cgroup() -> None:
    cgroup = f"12:cpu,cpuacct:{POD}\n4:cpuset:{POD}\n0::{POD}\n"
    files = {"/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "100000", "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"}
    # Docker and the kubelet mount the container's own cgroup at the hierarchy's root: the host path is not there.
    assert cgroup_cpu_limit(cgroup, HYBRID_MOUNTS, files.get) == 1.0
    unlimited = {**files, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1"}
    assert cgroup_cpu_limit(cgroup, HYBRID_MOUNTS, unlimited.get) is None


def test_a_host_path_inside_a_mount_whose_root_is_a_subtree() -> None:
    mount = "50 40 0:29 /kubepods /sys/fs/cgroup rw - cgroup2 cgroup2 rw"
    files = {"/sys/fs/cgroup/burstable/cpu.max": "100000 100000", "/sys/fs/cgroup/burstable/pod1234/abcd/cpu.max": "max"}
    assert cgroup_cpu_limit(f"0::{POD}", mount, files.get) == 1.0


def test_no_cgroup_or_an_unrelated_v1_controller_is_no_limit() -> None:
    files = {"/sys/fs/cgroup/cpuset/cpu.cfs_quota_us": "100000", "/sys/fs/cgroup/cpuset/cpu.cfs_period_us": "100000"}
    assert cgroup_cpu_limit("4:cpuset:/\n", HYBRID_MOUNTS, files.get) is None
    assert cgroup_cpu_limit("", "", files.get) is None


def test_whole_cpus_for_threads_round_down_at_least_one() -> None:
    assert [cpus_from_limit(x) for x in (0.1, 1.0, 1.99, 2.0, 3.0000000001, 0.3 * 10)] == [1, 1, 1, 2, 3, 3]


def test_this_machines_limit_is_read_without_error() -> None:
    limit = container_cpus()
    assert limit is None or limit >= 1
