"""Machine facts a long job reads: the memory left to it."""
import platform

from pad.machine import available_memory, release_free_memory


def test_available_memory_takes_the_tighter_of_the_kernel_and_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(meminfo, cgroup) == 20000000 * 1024  # no cgroup files: the kernel's figure
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("5000\n")
    assert available_memory(meminfo, cgroup) == 20000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{3 << 30}\n")
    assert available_memory(meminfo, cgroup) == 5 << 30  # the container's limit leaves less
    (cgroup / "memory.current").write_text(f"{9 << 30}\n")
    assert available_memory(meminfo, cgroup) == 0  # over its limit: nothing left, never negative
    assert available_memory(tmp_path / "none", tmp_path / "none") is None  # neither known


def test_release_free_memory_needs_glibc():
    assert release_free_memory() is (platform.libc_ver()[0] == "glibc")
