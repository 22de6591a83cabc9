"""Stop strings in the detokenizer: the tail held back for a possible stop string is the longest
one (checked against trying every length), and its cost per token does not grow with the stop
strings' length, so a request with megabytes of them slows no one's steps."""
import random
import time

from glmc.runtime.engine.tokenizer import Detokenizer


def held_back(text: str, stop: list[str]) -> int:
    """The longest tail of `text` that is a proper prefix of a stop string (every length tried)."""
    return max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                if text.endswith(s[:k])), default=0)


def detokenizer(text: str, stop: list[str]) -> Detokenizer:
    d = Detokenizer(None, stop)
    d.text = text
    return d


def test_held_back_is_the_longest_tail_that_begins_a_stop_string():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(0, 30)))
        stop = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 8)))
                for _ in range(rng.randrange(1, 4))]
        assert detokenizer(text, stop)._held_back() == held_back(text, stop), (text, stop)
    assert detokenizer("one, two, thr", ["three"])._held_back() == 3
    assert detokenizer("abab", ["ababc"])._held_back() == 4 and \
        detokenizer("aab", ["abx", "aabx"])._held_back() == 3


def test_held_back_costs_little_with_long_stop_strings():
    """16 stop strings of 64 Ki characters over 8000 characters of output: trying every length
    took ~50 ms a token here; finding the stop strings' first characters takes well under 1."""
    stop = [chr(0x4e00 + k) * 65536 for k in range(16)]
    d = detokenizer("hello world " * 667 + chr(0x4e00) * 10, stop)
    t0 = time.perf_counter()
    for _ in range(10):
        assert d._held_back() == 10
    assert (time.perf_counter() - t0) / 10 < 0.005
