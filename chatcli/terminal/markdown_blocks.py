"""A streamed Markdown reply cut into blocks, as the terminal draws it: pure text.

Owns: where one block ends and the next begins while the text still streams (BlockSplitter),
how much of a long open block a live view needs (its last screenful, with the lines that give
it meaning), and the Markdown source that shows what the model wrote (markdown_kept: a `*`
in arithmetic and a `<` outside code stay as written). Knows nothing of Rich or the terminal:
render.py draws the blocks; this only says what they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_FENCE_OPEN = re.compile(r"^( *)(`{3,}|~{3,})(.*)$")
_FENCE_CLOSE = re.compile(r"^ *(`{3,}|~{3,}) *$")
_HEADING = re.compile(r"^ {0,3}#{1,6}(\s|$)")
# A thematic break: three or more of one of - * _, spaces between allowed.
_RULE = re.compile(r"^ {0,3}(?:(?:-[ \t]*){3,}|(?:\*[ \t]*){3,}|(?:_[ \t]*){3,})$")
# Only items at column 0 split the reply: nested items stay with their parent.
# Groups: the bullet, or the number and its delimiter.
_LIST_ITEM = re.compile(r"^(?:([-+*])|(\d{1,9})([.)]))(?=\s|$)")
# A table's second line: | --- | :-: |
_TABLE_RULE = re.compile(r"^ {0,3}\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")
# What a line's text sits in: list markers and quote marks (`1. `, `- > `).
_CONTAINER = re.compile(r"^ {0,3}(?:(?:[-+*]|\d{1,9}[.)])(?: +|$)|> ?)*")
_SPACE = re.compile(r"\s+")
# Rows of prose drawn above the screen's top, in case it wraps into fewer rows than its
# characters would fill.
LIVE_MARGIN_ROWS = 8


def _indent(line: str) -> int:
    spaced = line.expandtabs(4)
    return len(spaced) - len(spaced.lstrip(" "))


def _list_kind(line: str) -> str | None:
    """Which list a top-level item belongs to: its bullet, or its number's delimiter. Items of
    one kind make one list; a new kind starts another (CommonMark)."""
    item = _LIST_ITEM.match(line)
    return None if item is None else item.group(1) or item.group(3)


def _content_column(line: str) -> int:
    """Where a list item's text starts (CommonMark): after its marker and 1-4 spaces. A line
    indented that far after a blank line still belongs to the item."""
    item = _LIST_ITEM.match(line)
    assert item is not None
    rest = line[item.end() :].expandtabs(4)
    spaces = len(rest) - len(rest.lstrip(" "))
    return item.end() + (spaces if 1 <= spaces <= 4 and rest.strip() else 1)


@dataclass(frozen=True)
class Block:
    """One block of markdown source, and whether a blank line goes before it."""

    text: str
    gap: bool


class BlockSplitter:
    """Cuts streamed markdown into blocks at line ends. A blank line ends a block (except in
    a code fence, or before a line indented into the open list item); a closing fence ends a
    fenced block of its own; a heading is a block of its own; a new top-level list item
    starts a block, so a long list is committed item by item."""

    def __init__(self) -> None:
        self._lines: list[str] = []  # complete lines of the open block
        self._partial = ""  # the line being written
        self._fence: str | None = None  # the opening fence while inside fenced code
        self._fence_indent = 0  # what fenced lines are moved left by (see _dedent)
        self._fence_at = 0  # the opening fence's index in _lines
        self._item_column: int | None = None  # the open block's list item's content column
        # Blank lines after an open list item's text: kept out until the next line shows
        # whether the item goes on (a paragraph or code indented into it) or has ended.
        self._blank_lines = 0
        self._committed_any = False
        self._last_list: str | None = None  # the list kind of the last block committed
        # The number the next item of an ordered list shows: as in CommonMark, a list counts
        # on from its first item's number, whatever the later items say ("1. 1. 1." is 1, 2,
        # 3). Each item is drawn as a list of its own, so the number is written in.
        self._next_number = 1

    def feed(self, text: str) -> list[Block]:
        """Adds text; returns the blocks it finished."""
        self._partial += text
        done: list[Block] = []
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            done += self._take_line(line.rstrip("\r"))
        return done

    def close(self) -> list[Block]:
        """The reply is over: the open block, if any, is finished as it stands."""
        done = self._take_line(self._partial) if self._partial else []
        self._partial = ""
        return done + self._commit()

    def open_block(self) -> Block | None:
        if not self._partial:
            return self._block(self._lines)
        blanks = [""] * self._blank_lines
        return self._block([*self._lines, *blanks, self._dedent(self._partial)])

    def live_block(self, height: int, width: int) -> Block | None:
        """The open block as the live area draws it. Once it is taller than a screen of
        `height` rows and `width` columns, only its tail, behind what gives the tail its
        meaning: the opening fence (the language, and that it is code), a table's header, a
        list item's marker. So a repaint costs about a screenful however long the block
        grows; the whole block is drawn once, when it is committed."""
        lines = self._lines
        rest = [*[""] * self._blank_lines, self._dedent(self._partial)] if self._partial else []
        n = len(lines) + len(rest)

        def line(i: int) -> str:
            return lines[i] if i < len(lines) else rest[i - len(lines)]

        code = self._fence is not None
        table = not code and n > 1 and "|" in line(0) and _TABLE_RULE.match(line(1)) is not None
        # Code indented 4 spaces: each line its own row, as in a fence, with no head to keep.
        indented = n > 0 and not code and not table and _indent(line(0)) >= 4
        whole_lines = code or table or indented
        first = self._fence_at + 1 if code else 2 if table else 0  # the first line to cut
        # A line of code or a row takes a row at least; prose is counted by its characters,
        # and may take fewer rows than they would fill (markup takes room in the source only).
        rows = height + (1 if whole_lines else LIVE_MARGIN_ROWS)
        start, offset = _tail_start(line, n, first, rows, width, lines_fill=whole_lines)
        if (start, offset) == (first, 0):
            return self.open_block()
        container = _CONTAINER.match(line(0))[0]
        # Spaces alone are no container: a list marker or a quote mark is.
        marker = "" if table or indented or not container.strip() else container
        # "…" stands for what was cut, and keeps a cut line from reading as a new block.
        head = [f"{marker}…"] if marker and start > 0 else []
        if code:
            head.append(line(self._fence_at))
        elif table:
            head += [line(0), line(1)]
        cut = line(start)[max(offset, len(marker)) if start == 0 else offset :]
        if whole_lines or (marker and offset == 0):
            tail = cut  # a whole line of code, a row, or an item's own line as it is
        else:
            tail = f"{marker if start == 0 else ''}…{cut.lstrip()}"
        return self._block([*head, tail, *(line(i) for i in range(start + 1, n))])

    def _take_line(self, line: str) -> list[Block]:
        if self._fence is not None:
            self._lines.append(self._dedent(line))
            closing = _FENCE_CLOSE.match(line)
            if closing and closing.group(1).startswith(self._fence):
                self._fence = None
                # Code inside a list item ends there, the item does not.
                return self._commit() if self._item_column is None else []
            return []
        if not line.strip():
            if self._item_column is None:
                return self._commit()
            self._blank_lines += 1
            return []
        # Indented into the open list item: its text, code or nested list, whatever it is.
        inside_item = self._item_column is not None and _indent(line) >= self._item_column
        done: list[Block] = []
        if self._blank_lines and inside_item:
            self._lines += [""] * self._blank_lines
            self._blank_lines = 0
        elif self._blank_lines:
            done = self._commit()
        fence = _FENCE_OPEN.match(line)
        if fence and fence.group(2)[0] == "`" and "`" in fence.group(3):
            fence = None  # a backtick fence's info string may not hold backticks: inline code
        heading = _HEADING.match(line)
        # A rule is a block of its own where it ends a list item or stands alone; under a
        # paragraph a line of dashes underlines it as a heading instead (setext).
        setext = bool(self._lines) and not self._item_column and line.lstrip().startswith("-")
        rule = _RULE.match(line) is not None and not setext
        if not inside_item and (fence or heading or rule or self._starts_item(line)):
            done += self._commit()
        if fence:
            self._fence, self._fence_at = fence.group(2), len(self._lines)
            self._fence_indent = 0 if inside_item else len(fence.group(1))
            line = self._dedent(line)
        if not self._lines and _LIST_ITEM.match(line):
            self._item_column = _content_column(line)
        self._lines.append(line)
        if (heading or rule) and not inside_item:
            done += self._commit()
        return done

    def _starts_item(self, line: str) -> bool:
        item = _LIST_ITEM.match(line)
        if item is None:
            return False
        # As in CommonMark, only a bullet or "1." may interrupt a paragraph; "2019. was" may not.
        number = item.group(2)
        in_list = not self._lines or _LIST_ITEM.match(self._lines[0]) is not None
        return number is None or int(number) == 1 or in_list

    def _dedent(self, line: str) -> str:
        """Fenced code is moved left by its fence's indent, so a fence indented less than a
        list item's text still renders as code when it stands alone as a block. (Code
        inside the item is not moved: it is drawn in the item.)"""
        if self._fence is None:
            return line
        indent = len(line) - len(line.lstrip(" "))
        return line[min(indent, self._fence_indent) :]

    def _block(self, lines: list[str]) -> Block | None:
        if not "".join(lines).strip():
            return None
        # Rich's Markdown puts a blank line between top-level blocks; items of one list touch,
        # also where the model left a blank line between them.
        kind = _list_kind(lines[0])
        gap = self._committed_any and (kind is None or kind != self._last_list)
        item = _LIST_ITEM.match(lines[0])
        if item and item.group(2) and not gap and kind == self._last_list:
            number = str(self._next_number)
            # The item's own lines sit at its content column, which moves with the number's
            # width (9. -> 10.): they move with it, or a nested list or code falls out.
            shift = len(number) - len(item.group(2))
            lines = [
                f"{number}{lines[0][item.end(2) :]}",
                *(_shifted(line, shift) for line in lines[1:]),
            ]
        return Block("\n".join(lines), gap)

    def _commit(self) -> list[Block]:
        block = self._block(self._lines)
        self._lines = []
        self._item_column, self._blank_lines = None, 0
        if block is None:
            return []
        self._committed_any, self._last_list = True, _list_kind(block.text)
        item = _LIST_ITEM.match(block.text)
        if item and item.group(2):
            self._next_number = int(item.group(2)) + 1
        return [block]


def _shifted(line: str, by: int) -> str:
    """line moved right by `by` columns (left, where negative, as far as its spaces go)."""
    if not line.strip():
        return line
    if by >= 0:
        return " " * by + line
    return line[min(-by, len(line) - len(line.lstrip(" "))) :]


def _tail_start(
    line: Callable[[int], str], n: int, first: int, rows: int, width: int, lines_fill: bool
) -> tuple[int, int]:
    """Where the tail of lines `first`..n-1 that fills `rows` rows of `width` columns
    starts: (line, offset in it); (first, 0) when all of them fit. A line takes at least
    len/width rows (code wraps too); in code and tables (`lines_fill`) it also takes one row
    at least, while prose lines flow together, so for them only the characters count. A cut
    through prose moves by a screenful at a time, not on every token: a paragraph cut at a
    new place would reflow the whole screen."""
    budget = rows * width
    chars = 0
    for i in range(n - 1, first - 1, -1):
        size = len(line(i))
        if chars + size >= budget:  # the cut is inside line i
            offset = (size - (budget - chars)) // budget * budget
            if offset and not lines_fill:
                space = _SPACE.search(line(i), offset, offset + width)  # at a word
                offset = space.end() if space else offset
            if offset:
                return i, offset
            break
        chars += size + 1
        if n - i >= (rows if lines_fill else 4 * rows):
            break
    else:
        return first, 0
    if not lines_fill:  # a whole-line cut: at a multiple of `rows`, while that stays cheap
        rounded = max(first, i - i % rows)
        if sum(len(line(j)) for j in range(rounded, i)) <= budget:
            return rounded, 0
    return i, 0


# A `*` between a word (or a closing bracket) and a word (or an opening one), as in 6*7*7,
# 3*x + 2*y or a*b*c: arithmetic. Markdown would read a pair as emphasis and drop both
# (677, 3x + 2y). Emphasis keeps its stars: `*it*` and `**bold**` have a space or a star
# on their outer side. A power, 2**10, is arithmetic too (between digits only: the closing
# stars of **bold**text stand between letters). ASCII words only: Chinese or Japanese text
# has no spaces around its emphasis.
_STAR_IN_ARITHMETIC = re.compile(r"(?<=[\w)])\*(?=[\w(])|(?<=[\d)])\*\*(?=[\d(])", re.ASCII)
# A name wrapped in double underscores (__init__, __name__): Markdown would read it as bold.
_DUNDER = re.compile(r"(?<![\w\\])__(\w+?)__(?!\w)")
# A `<` not escaped already: Markdown reads `<String>`, `<iostream>` or `<b and c>` as HTML,
# and Rich drops HTML, text and all.
_OPEN_ANGLE = re.compile(r"(?<!\\)((?:\\\\)*)<")
# Where a code span or a URL autolink (<http://...>) may start: escapes would show in both.
# (Markdown takes any <scheme:text> for a link, but a model writing <std::string> means the
# text.) A span's closing run of backticks is found by _code_and_links.
_SPAN_OR_LINK = re.compile(r"`+|<[A-Za-z][A-Za-z0-9+.-]*://[^<>\s]*>|<mailto:[^<>\s]*>")
# The `<` of the badges' own <kbd> tags, until markdown_kept has escaped the model's `<`.
# A control character: visible() has made every one in the model's text a picture.
TAG = "\x02"


# ASCII punctuation: a backslash before any of it shows the character itself.
_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


# A table cell's edge: a `|` not escaped (GFM cuts cells before it reads code spans).
_CELL_EDGE = re.compile(r"((?<!\\)\|)")


def _prose_kept(text: str) -> str:
    """Running text (no code blocks) with its arithmetic `*` and its `<` escaped, except in
    code spans; an autolink becomes its address as plain text (_autolink_text). A table's
    rows are read cell by cell: a code span cannot run from one cell into the next."""
    lines = text.split("\n")
    table = next(
        (
            i - 1
            for i in range(1, len(lines))
            if "|" in lines[i - 1] and _TABLE_RULE.match(lines[i])
        ),
        None,
    )
    if table is None:
        return _inline_kept(text)
    rows = [
        "".join(p if i % 2 else _inline_kept(p) for i, p in enumerate(_CELL_EDGE.split(row)))
        for row in lines[table:]
    ]
    return "\n".join([_inline_kept("\n".join(lines[:table])), *rows] if table else rows)


def _inline_kept(text: str) -> str:
    pieces = _code_and_links(text)  # the odd pieces are code spans and links
    return "".join(
        (_autolink_text(piece) if piece.startswith("<") else piece)
        if i % 2
        else _OPEN_ANGLE.sub(r"\1\\<", _kept_stars(piece))
        for i, piece in enumerate(pieces)
    )


def _code_and_links(text: str) -> list[str]:
    """text cut into running text (the even pieces) and code spans and autolinks (the odd
    ones). A code span runs from a run of backticks to the next run of as many (CommonMark),
    so ``a`<b`` is one span; a run with no such closer is text."""
    pieces, start, at = [], 0, 0
    while (found := _SPAN_OR_LINK.search(text, at)) is not None:
        end = found.end()
        before = found.start() - len(text[: found.start()].rstrip("\\"))
        if before % 2:  # an escaped ` or <: that character is text, the rest of a run not
            at = found.start() + 1
            continue
        if found[0][0] == "`":
            closer = re.compile(rf"(?<!`){found[0]}(?!`)").search(text, end)
            if closer is None:
                at = end  # backticks with no closer: text
                continue
            end = closer.end()
        pieces += [text[start : found.start()], text[found.start() : end]]
        start = at = end
    return [*pieces, text[start:]]


def _autolink_text(link: str) -> str:
    """<https://x.example> as its address, every punctuation mark escaped so that it shows
    as written: rendered as a link (hyperlinks off, so that the address shows where many
    terminals hide it) it read "https://x.example (https://x.example)"."""
    return _PUNCTUATION.sub(r"\\\1", link[1:-1])


def _kept_stars(text: str) -> str:
    stars = _STAR_IN_ARITHMETIC.sub(lambda m: m[0].replace("*", "\\*"), text)
    return _DUNDER.sub(r"\_\_\1\_\_", stars)


_QUOTE_MARKS = re.compile(r"^ {0,3}(?:> ?)+")


def markdown_kept(text: str) -> str:
    """Markdown source that shows what the model wrote: a `*` between digits stays a star
    (6*7*7 would read as emphasis and show 677) and a `<` stays a `<` (see _OPEN_ANGLE).
    Code, fenced, indented or inline, is left as it is."""
    first = text.partition("\n")[0]
    base = _content_column(first) if _LIST_ITEM.match(first) else 0  # code is 4 in from it
    kept: list[str] = []
    prose: list[str] = []  # lines of running text: a code span may go over a line end

    def keep(code_line: str) -> None:
        if prose:
            kept.append(_prose_kept("\n".join(prose)))
            prose.clear()
        kept.append(code_line)

    fence: str | None = None
    quoted_fence = False  # the fence opened inside a quote: its lines are read after the marks
    indented = False  # inside indented code
    after_blank = True  # indented code starts a block or follows a blank line
    for line in text.split("\n"):
        marks = _QUOTE_MARKS.match(line)
        body = line[marks.end() :] if marks else line  # in a quote, code follows its marks
        if fence is not None:
            if quoted_fence and not marks:  # the quote ended, and the code in it with it
                fence = None
            else:
                closing = _FENCE_CLOSE.match(body if quoted_fence else line)
                if closing and closing.group(1).startswith(fence):
                    fence = None
                keep(line)
                continue
        if not body.strip():
            after_blank = True
            keep(line)  # a blank line ends a paragraph, and any code span with it
            continue
        indented = _indent(body) >= base + 4 and (after_blank or indented)
        after_blank = False
        opening = _FENCE_OPEN.match(body)
        if opening and not indented and not (opening[2][0] == "`" and "`" in opening[3]):
            fence, quoted_fence = opening[2], marks is not None
        if fence is not None or indented:
            keep(line)
        else:
            prose.append(line)
    if prose:
        kept.append(_prose_kept("\n".join(prose)))
    return "\n".join(kept).replace(TAG, "<")
