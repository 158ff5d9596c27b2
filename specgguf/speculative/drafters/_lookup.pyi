from collections.abc import Sequence

MAX_LENGTH: int

def match_length(
    text: Sequence[int], after: int, end: int, n: int, stop: int | None = None, /
) -> int: ...
def suffix_chain(
    corpus: Sequence[int],
    end: int,
    occ: Sequence[int],
    k: int,
    share_min: float,
    separator: int,
    /,
) -> tuple[list[int], list[float]]: ...
def suffix_tree(
    corpus: Sequence[int],
    end: int,
    occ: Sequence[int],
    max_nodes: int,
    max_leaves: int,
    min_prob: float,
    enough: int,
    branch: int,
    separator: int,
    /,
) -> tuple[list[int], list[int], list[float]]: ...

class NgramTable:
    nbytes: int
    length: int
    def __init__(self, n_min: int, n_max: int) -> None: ...
    def extend(self, history: Sequence[int], stop: int) -> None: ...
    def find(
        self, history: Sequence[int], size: int, n_hi: int
    ) -> tuple[int, int, int, int] | None: ...
    def clear(self) -> None: ...
    def entries(self) -> list[tuple[int, int, int, int]]: ...

class SuffixTable:
    nbytes: int
    def __init__(self, lengths: Sequence[int], max_occurrences: int, separator: int) -> None: ...
    def index(self, corpus: Sequence[int], start: int, stop: int) -> None: ...
    def match(self, corpus: Sequence[int], end: int, n_hi: int) -> tuple[int, list[int]] | None: ...
    def clear(self) -> None: ...
    def entries(self) -> list[tuple[int, list[int]]]: ...
