import pytest
from hypothesis import given, strategies as st

from deploykit import cpulist


def test_parse_and_format_roundtrip_kernel_syntax():
    assert cpulist.parse("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert cpulist.format([11, 10, 8, 3, 2, 1, 0, 2]) == "0-3,8,10-11"
    assert cpulist.parse("") == () and cpulist.format([]) == ""


@pytest.mark.parametrize("bad", ["1-", "a", "3-1", "1,,2", "-4"])
def test_parse_rejects_garbage(bad):
    with pytest.raises(ValueError):
        cpulist.parse(bad)


def test_parse_mask_like_proc_status():
    assert cpulist.parse_mask("ff,00000001") == (0, 32, 33, 34, 35, 36, 37, 38, 39)


@given(st.sets(st.integers(0, 600)))
def test_roundtrip_any_set(ids):
    assert cpulist.parse(cpulist.format(ids)) == tuple(sorted(ids))
