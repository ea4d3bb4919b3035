import pytest

from chatcli.terminal.markdown_blocks import BlockSplitter, markdown_kept


@pytest.mark.parametrize("source", ["~~~\nx = 2*3*4\n~~~", "```python\nx = 2*3*4"])
def test_code_keeps_its_stars_unescaped(source):
    assert markdown_kept(source) == source


def test_an_autolink_becomes_its_address_shown_once_as_written():
    import io

    from rich.console import Console
    from rich.markdown import Markdown

    source = "see <https://x.example/a_b*c?q=1&r=[2]> and <mailto:a@b.c>, `<https://c.d>`"
    out = io.StringIO()
    Console(file=out, width=120).print(Markdown(markdown_kept(source), hyperlinks=False))
    assert out.getvalue().strip() == (
        "see https://x.example/a_b*c?q=1&r=[2] and mailto:a@b.c, <https://c.d>"
    )


def test_a_live_tail_of_a_long_paragraph_keeps_its_place_for_a_while():
    splitter = BlockSplitter()
    splitter.feed(" ".join(f"word{n}" for n in range(5000)))
    tail = splitter.live_block(height=30, width=100)
    splitter.feed(" more words")  # a cut that moved with each token would reflow the screen
    assert splitter.live_block(height=30, width=100).text == tail.text + " more words"


@pytest.mark.parametrize(
    ("source", "kept"),
    [
        ("a<b", "a\\<b"),
        ("a\\<b", "a\\<b"),  # escaped already
        ("`a<b` a<b", "`a<b` a\\<b"),
        ("``a`<b`` a<b", "``a`<b`` a\\<b"),  # a span of two backticks holds one
        ("x ``` y<z", "x ``` y\\<z"),  # backticks with no closer are text
        ("<std::string>, <http://x.example>", "\\<std::string>, http\\:\\/\\/x\\.example"),
        ("1. x\n\n       a<b\n   c<d", "1. x\n\n       a<b\n   c\\<d"),  # code in the item
    ],
)
def test_markdown_kept_escapes_angle_brackets_outside_code(source, kept):
    assert markdown_kept(source) == kept


def test_the_live_tail_of_indented_code_stays_code():
    # Four spaces make code: its tail is whole indented lines, not a paragraph reflowed.
    splitter = BlockSplitter()
    splitter.feed("".join(f"    value_{n} = f({n})\n" for n in range(400)))
    tail = splitter.live_block(height=20, width=80).text.split("\n")
    assert 20 <= len(tail) <= 25
    assert all(line.startswith("    value_") for line in tail if line)
    assert tail[-1] == "    value_399 = f(399)" or tail[-2] == "    value_399 = f(399)"


@pytest.mark.parametrize(
    "source",
    [
        "> Quoted indented code:\n>\n>     Vec<String> x = 6*7*7;",
        "> ```js\n> const s = a<b;\n> ```",
    ],
)
def test_code_inside_a_quote_is_left_as_written(source):
    assert markdown_kept(source) == source


def test_prose_inside_a_quote_is_still_kept():
    assert markdown_kept("> a<b and 3*x") == "> a\\<b and 3\\*x"


def test_a_fence_left_open_in_a_quote_ends_with_the_quote():
    kept = markdown_kept("> ```\n> x <y>\n\nafter 6*7*7 is <b>")
    assert kept == "> ```\n> x <y>\n\nafter 6\\*7\\*7 is \\<b>"


def test_a_quoted_fence_line_inside_a_fence_is_code():
    source = "```markdown\n> ```\n> 6*7*7 <x>\n> ```\n```"
    assert markdown_kept(source) == source


@pytest.mark.parametrize(
    ("source", "kept"),
    [
        ("2**10 = 1024", "2\\*\\*10 = 1024"),  # a power
        ("**bold**text", "**bold**text"),  # bold against a word stays bold
        ("这是*重点*内容", "这是*重点*内容"),  # emphasis in text without spaces
    ],
)
def test_powers_keep_their_stars_and_emphasis_without_spaces_stays(source, kept):
    assert markdown_kept(source) == kept


def test_an_ordered_list_counts_on_from_its_first_number_as_commonmark_does():
    # Each item is committed, and drawn, as a list of its own: the number is written in.
    splitter = BlockSplitter()
    blocks = splitter.feed("Steps:\n1. one\n1. two\n")
    assert splitter.open_block().text == "2. two"  # the live view counts on too
    blocks += splitter.feed("1. three\n")
    assert splitter.open_block().text == "3. three"
    blocks += splitter.feed("\nDone.\n\n7) a\n1) b\n- x\n1. c\n")
    blocks += splitter.close()
    assert [b.text for b in blocks] == [
        "Steps:",
        "1. one",
        "2. two",
        "3. three",
        "Done.",
        "7) a",
        "8) b",
        "- x",
        "1. c",
    ]
    assert [b.gap for b in blocks] == [False, True, False, False, True, True, False, True, True]


def test_an_item_s_own_lines_move_with_its_number_s_width():
    # 9. -> 10. moves the item's content column: its nested list and code move with it.
    splitter = BlockSplitter()
    text = "".join(f"1. step {i}\n   - sub {i}\n" for i in range(1, 11))
    blocks = splitter.feed(text + "1. last\n\n       code<b>\n\n   more\n") + splitter.close()
    assert blocks[8].text == "9. step 9\n   - sub 9"
    assert blocks[9].text == "10. step 10\n    - sub 10"
    assert blocks[10].text == "11. last\n\n        code<b>\n\n    more"


def test_a_rule_ends_a_list_and_a_line_of_dashes_under_text_is_a_heading():
    splitter = BlockSplitter()
    blocks = splitter.feed("1. a\n---\n1. b\n\nTitle\n---\ntext\n* * *\n") + splitter.close()
    assert [b.text for b in blocks] == ["1. a", "---", "1. b", "Title\n---\ntext", "* * *"]


@pytest.mark.parametrize(
    ("source", "shown"),
    [
        ("see \\<https://x.example>", "see <https://x.example>"),  # escaped: no link
        ("a \\``code<T>`", "a `code<T>"),  # an escaped backtick, then a code span
    ],
)
def test_escaped_brackets_and_backticks_stay_text(source, shown):
    import io

    from rich.console import Console
    from rich.markdown import Markdown

    out = io.StringIO()
    Console(file=out, width=120).print(Markdown(markdown_kept(source), hyperlinks=False))
    assert out.getvalue().strip() == shown


def test_a_code_span_does_not_run_from_one_table_cell_into_another():
    import io

    from rich.console import Console
    from rich.markdown import Markdown

    source = "Here:\n| a | b |\n|---|---|\n| ` | <T> |\n| x | `a<b` \\| c |"
    out = io.StringIO()
    Console(file=out, width=60).print(Markdown(markdown_kept(source), hyperlinks=False))
    shown = [" ".join(row.split()) for row in out.getvalue().splitlines() if row.strip()]
    assert shown[0] == "Here:" and "` <T>" in shown and "x a<b | c" in shown
