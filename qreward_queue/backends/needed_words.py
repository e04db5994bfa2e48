"""Words a regular expression cannot match without: a cheap look before a costly search.

`needed_words(pattern)` reads the parsed pattern (the standard library's own parser) and
returns sets of words such that every match contains a word of each set: a text holding no
word of one set cannot match, so the search is skipped. Substring tests run at memory speed,
while a pattern that begins with an alternation or an optional group is tried at every
position of the text. `Look` holds the words of many patterns and tests each word once per
text: one test per pattern and word costs more than the searches it saves on a short text.
Sound by construction: only parts every match must contain are read (literal runs, groups,
repeats of at least one, alternations whose every branch needs a word); everything else is
passed over, which only leaves fewer words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any, Generic, TypeVar

MIN_WORD = 3  # shorter words are in nearly every text: not worth a look
MAX_SETS = 2  # the most telling sets kept per pattern

Needs = tuple[frozenset[str], ...]
T = TypeVar("T")


def needed_words(pattern: re.Pattern[str]) -> Needs:
    """Sets of words, each set holding a word of every match of `pattern`: the most telling
    (longest shortest word, then fewest words) first; () when nothing is known."""
    if pattern.flags & re.IGNORECASE:  # its literals match in any case: not read here
        return ()
    found = _needed(sre_parse.parse(pattern.pattern, pattern.flags))
    useful = [words for words in found if min(map(len, words)) >= MIN_WORD]
    useful.sort(key=lambda words: (-min(map(len, words)), len(words)))
    return tuple(useful[:MAX_SETS])


class Look(Generic[T]):
    """Which of `entries` (pattern, tag) are worth searching in a text, in their order. The
    tag comes back with its pattern: a pattern's own hash reads its whole compiled code."""

    def __init__(self, entries: Iterable[tuple[re.Pattern[str], T]]) -> None:
        self.entries = list(entries)
        self._needs = [(entry, needed_words(entry[0])) for entry in self.entries]
        self.words = tuple(sorted({w for _, needs in self._needs for ws in needs for w in ws}))

    def searches(self, text: str) -> list[tuple[re.Pattern[str], T]]:
        """The entries whose pattern `text` holds a word of every needed set of: the others
        cannot match."""
        present = frozenset(filter(text.__contains__, self.words))
        found = []
        for entry, needs in self._needs:  # loops, not all(): this runs on every judge call
            for words in needs:
                if present.isdisjoint(words):
                    break
            else:
                found.append(entry)
        return found


def _needed(items: Any) -> list[frozenset[str]]:
    """The word sets of a parsed sequence: each of its parts that every match contains."""
    sets: list[frozenset[str]] = []
    run = ""
    for op, av in items:
        if op is sre.LITERAL:  # consecutive literals are one word of the match
            run += chr(av)
            continue
        if run:
            sets.append(frozenset([run]))
            run = ""
        if op is sre.SUBPATTERN:
            sets += _needed(av[-1])
        elif op is sre.ATOMIC_GROUP:
            sets += _needed(av)
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT) and av[0] >= 1:
            sets += _needed(av[2])
        elif op is sre.BRANCH:  # a word of whichever branch matched
            best = [_most_telling(_needed(branch)) for branch in av[1]]
            if all(best):
                sets.append(frozenset().union(*best))
    if run:
        sets.append(frozenset([run]))
    return sets


def _most_telling(sets: list[frozenset[str]]) -> frozenset[str]:
    return max(sets, key=lambda words: (min(map(len, words)), -len(words)), default=frozenset())
