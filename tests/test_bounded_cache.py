"""bounded_cache: an lru_cache for short string keys; long ones are computed every call."""

from __future__ import annotations

from gptoss_serve.bounded_cache import bounded_cache


def test_short_keys_are_kept_long_ones_never() -> None:
    calls: list[str] = []

    @bounded_cache(maxsize=2, max_key_chars=4)
    def length(key: str) -> int:
        """Its docstring stays."""
        calls.append(key)
        return len(key)

    assert [length(k) for k in ("ab", "ab", "abcde", "abcde", "abcd")] == [2, 2, 5, 5, 4]
    assert calls == ["ab", "abcde", "abcde", "abcd"]  # "ab" once, the 5-char key twice
    info = length.cache_info()
    assert (info.hits, info.currsize, info.maxsize) == (1, 2, 2)
    length("xy")  # evicts "ab", the least recently used
    length("ab")
    assert calls[-2:] == ["xy", "ab"]
    length.cache_clear()
    assert length.cache_info().currsize == 0
    assert length.__doc__ == "Its docstring stays." and length.__name__ == "length"
