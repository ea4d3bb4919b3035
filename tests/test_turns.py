from chatcli.chat.turns import readable_text


def test_bytes_that_were_not_utf8_become_replacement_characters():
    assert readable_text("hi\udcff") == "hi\ufffd"  # b"hi\xff" read with surrogateescape
    assert readable_text("x\ud800y") == "x\ufffdy"  # a lone surrogate from anywhere else
    assert readable_text("a\udcff\ud800b").encode("utf-8") == "a\ufffd\ufffdb".encode()


def test_utf8_split_across_escaped_bytes_comes_back_whole():
    # "café" read in the C locale: its é arrives as two escaped bytes.
    assert readable_text("caf\udcc3\udca9") == "café"


def test_text_that_is_already_utf8_is_left_alone():
    for text in ("plain", "café 東京 🙂", ""):
        assert readable_text(text) is text or readable_text(text) == text
