"""Transparent huge pages for loaded weights (specgguf.llama.hugepages)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specgguf.hub import testmodels
from specgguf.llama import hugepages as hp
from specgguf.llama.backend import LlamaModel

MiB = 1 << 20

MAPS = """\
55d0c8a00000-55d0c8a21000 r--p 00000000 08:01 1234   /usr/bin/python3.11
55d0c9000000-55d0c9400000 rw-p 00000000 00:00 0      [heap]
7f0000000000-7f0040000000 rw-p 00000000 00:00 0
7f0040000000-7f0040100000 ---p 00000000 00:00 0
7f0050000000-7f0050800000 rw-s 00000000 00:05 99     /dev/shm/x
7f0060000000-7f0060001000 rw-p 00000000 00:00 0 \n\
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
"""


def test_anonymous_ranges_are_the_writable_unnamed_mappings() -> None:
    assert hp.anonymous_ranges(MAPS) == [
        (0x7F0000000000, 0x7F0040000000),
        (0x7F0060000000, 0x7F0060001000),
    ]


def test_new_ranges_are_the_parts_not_mapped_before() -> None:
    before = [(100, 200), (300, 400)]
    after = [(100, 200), (50, 450), (500, 600)]
    # (50, 450) keeps what lies outside both old ranges; (500, 600) is new whole.
    assert hp.new_ranges(before, after) == [(50, 100), (200, 300), (400, 450), (500, 600)]
    assert hp.new_ranges(after, after) == []


def test_huge_aligned_keeps_whole_2mib_pages_of_large_ranges() -> None:
    big = (3 * MiB + 17, 40 * MiB + 5)  # whole huge pages: 4 MiB .. 40 MiB
    small = (100 * MiB, 104 * MiB)  # under MIN_RANGE (8 MiB)
    assert hp.huge_aligned([big, small]) == [(4 * MiB, 40 * MiB)]
    assert hp.huge_aligned([small], min_size=0) == [small]
    assert hp.huge_aligned([(1 * MiB, 3 * MiB)], min_size=0) == []  # no whole 2 MiB page


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hp.thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hp.thp_mode(str(f)) == "always"
    assert hp.thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    ("env", "default", "mode", "want"),
    [
        (None, True, "madvise", True),
        (None, False, "madvise", False),
        ("0", True, "madvise", False),
        ("off", True, "always", False),
        ("1", False, "madvise", True),
        ("1", False, "never", False),  # the kernel refuses: nothing to advise
        ("auto", True, "madvise", True),  # a word it does not know: the default
        ("auto", False, "madvise", False),
        (None, True, None, False),  # no THP at all
    ],
)
def test_enabled_lets_the_environment_override_the_default(
    monkeypatch: pytest.MonkeyPatch, env: str | None, default: bool, mode: str | None, want: bool
) -> None:
    if env is None:
        monkeypatch.delenv("SPECGGUF_HUGEPAGES", raising=False)
    else:
        monkeypatch.setenv("SPECGGUF_HUGEPAGES", env)
    monkeypatch.setattr(hp, "thp_mode", lambda: mode)
    monkeypatch.setattr(sys, "platform", "linux")
    assert hp.enabled(default) is want


def test_load_advice_advises_only_what_appeared_after_it_was_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPECGGUF_HUGEPAGES", raising=False)
    monkeypatch.setattr(hp, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(sys, "platform", "linux")
    line = "{:x}-{:x} rw-p 00000000 00:00 0\n"
    maps = [line.format(0, 64 * MiB)]
    monkeypatch.setattr(hp, "_read_maps", lambda: "".join(maps))
    advised: list[list[hp.Range]] = []
    monkeypatch.setattr(hp, "advise", lambda r: advised.append(r) or sum(b - a for a, b in r))
    monkeypatch.setattr(hp, "untouched", lambda r: r)  # the fake addresses are not mapped
    advice = hp.LoadAdvice(default=True)
    maps.append(line.format(100 * MiB + 4096, 300 * MiB))  # the load's buffer
    advice.on_progress(0.0)
    advice.on_progress(0.5)  # later calls do nothing
    assert advised == [[(102 * MiB, 300 * MiB)]]
    assert advice.advised == 198 * MiB


def test_untouched_keeps_the_huge_pages_with_no_page_written() -> None:
    import ctypes
    import mmap

    m = mmap.mmap(-1, 12 * MiB)  # anonymous, nothing resident yet
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    a = -(-base // (2 * MiB)) * (2 * MiB)
    try:
        ctypes.memset(a + 2 * MiB + 4096, 1, 1)  # one page of the second huge page written
        assert hp.untouched([(a, a + 8 * MiB)]) == [(a, a + 2 * MiB), (a + 4 * MiB, a + 8 * MiB)]
        ctypes.memset(a, 1, 8 * MiB)
        assert hp.untouched([(a, a + 8 * MiB)]) == []
    finally:
        m.close()


def test_an_error_while_advising_never_stops_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hp, "enabled", lambda default: True)
    monkeypatch.setattr(hp, "_read_maps", lambda: "")
    advice = hp.LoadAdvice()
    monkeypatch.setattr(hp, "_read_maps", lambda: "7f00-zz rw-p 00000000 00:00 0\n")  # garbage
    advice.on_progress(0.0)  # ValueError inside, not raised
    assert advice.advised == 0


def test_load_advice_does_nothing_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECGGUF_HUGEPAGES", "0")
    monkeypatch.setattr(hp, "_read_maps", lambda: pytest.fail("maps read while disabled"))
    advice = hp.LoadAdvice(default=True)
    advice.on_progress(0.0)
    assert advice.advised == 0


@pytest.mark.real_models
@pytest.mark.skipif(hp.thp_mode() not in ("madvise", "always"), reason="no transparent huge pages")
def test_a_model_loaded_with_huge_pages_has_its_weights_on_them(
    real_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECGGUF_HUGEPAGES", raising=False)
    path = real_models[testmodels.DRAFT]
    with LlamaModel(path, huge_pages=False) as model:
        assert model.huge_pages_advised == 0
        if not model.use_extra_bufts or model.offloads:
            pytest.skip("the weights are not copied into this process's memory here")
    before = hp.anon_huge_bytes()
    with LlamaModel(path, huge_pages=True) as model:
        size = path.stat().st_size
        # The repacked weights are about the file's size: most of it advised and backed.
        assert model.huge_pages_advised > 0.8 * size
        if hp.thp_mode() == "madvise":  # under "always" the other load's pages count too
            assert hp.anon_huge_bytes() - before > 0.7 * size
        with model.new_context(n_ctx=256) as ctx:
            logits = ctx.eval(model.tokenize("The capital of France is"), logits="last")
            assert logits.shape == (1, model.n_vocab)
