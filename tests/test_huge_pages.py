from pathlib import Path

import pytest
import torch

from compiled_spec.loading.huge_pages import copies_on_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_of(address: int) -> dict[str, str]:
    """The fields of the /proc/self/smaps entry whose range holds `address`."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            entry = {} if start <= address < end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
            if key == "VmFlags":
                return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_keep_values_layout_and_alignment():
    sources = [torch.randn(300, 700), torch.randn(40, 30).t(), torch.zeros(0), torch.arange(10) > 3,
               torch.randn(8, 16, dtype=torch.bfloat16), torch.arange(7, dtype=torch.int64)]
    copies = copies_on_huge_pages(sources)
    for source, copy in zip(sources, copies):
        assert copy.dtype == source.dtype and copy.shape == source.shape and copy.stride() == source.stride()
        assert torch.equal(copy, source)
        if copy.numel():
            assert copy.data_ptr() != source.data_ptr() and copy.data_ptr() % 64 == 0
    copies[0].add_(1)  # each copy owns its bytes
    assert torch.equal(copies[1], sources[1]) and torch.equal(copies[0], sources[0] + 1)


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this kernel offers no transparent huge pages")
def test_the_block_starts_on_a_huge_page_the_kernel_may_back_with_huge_pages():
    copy, = copies_on_huge_pages([torch.randn(1 << 20)])  # 4 MiB
    assert copy.data_ptr() % (2 << 20) == 0
    mapping = mapping_of(copy.data_ptr())
    assert "hg" in mapping["VmFlags"].split(), mapping["VmFlags"]  # advised MADV_HUGEPAGE
    assert mapping["THPeligible"] == "1"
