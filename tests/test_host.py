"""gr.utils.host: the host's available memory and this process's resident set, read from /proc text."""

import os

from gr.utils.host import available_memory_bytes, resident_bytes

MEMINFO = """MemTotal:       16318412 kB
MemFree:         1022820 kB
MemAvailable:    9203300 kB
Buffers:          402112 kB
"""


def test_available_memory_is_meminfos_memavailable_in_bytes(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    assert available_memory_bytes(str(path)) == 9203300 * 1024


def test_available_memory_is_unknown_without_a_readable_memavailable(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO.replace("MemAvailable:", "MemMissing:"))  # kernels before 3.14
    assert available_memory_bytes(str(path)) is None
    path.write_text("MemAvailable: many kB\n")
    assert available_memory_bytes(str(path)) is None
    assert available_memory_bytes(str(tmp_path / "absent")) is None


def test_resident_set_is_statms_second_field_in_pages(tmp_path):
    path = tmp_path / "statm"
    path.write_text("611642 39321 9527 1 0 93178 0\n")
    assert resident_bytes(str(path)) == 39321 * os.sysconf("SC_PAGE_SIZE")
    path.write_text("611642\n")
    assert resident_bytes(str(path)) is None
    assert resident_bytes(str(tmp_path / "absent")) is None
