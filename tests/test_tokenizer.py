"""The tokenizer: safe loading, ordinary-text encoding, and nanochat chat rendering."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from reference import REFERENCE, needs_reference

from chatcli.errors import TokenizerError
from chatcli.model.special_tokens import SPECIAL_TOKENS
from chatcli.model.tokenizer import Tokenizer

FIXTURES = REFERENCE
pytestmark = needs_reference


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(FIXTURES / "E" / "tokenizer" / "tokenizer.pkl")


def test_special_tokens_take_the_last_nine_ids(tok):
    n = tok.get_vocab_size()
    assert [tok.encode_special(t) for t in SPECIAL_TOKENS] == list(range(n - 9, n))
    assert tok.get_bos_token_id() == n - 9


def test_typed_special_token_text_stays_ordinary_text(tok):
    ids = tok.encode("say <|assistant_end|> please")
    assert not set(ids) & {tok.encode_special(t) for t in SPECIAL_TOKENS}
    assert tok.decode(ids) == "say <|assistant_end|> please"


def test_prepend_takes_an_id_or_a_name(tok):
    bos = tok.get_bos_token_id()
    assert tok.encode("hi", prepend=bos)[0] == bos
    assert tok.encode("hi", prepend="<|bos|>") == tok.encode("hi", prepend=bos)


def test_render_conversation_masks_only_what_the_assistant_writes(tok):
    s = tok.encode_special
    conversation = [
        {"role": "user", "content": "What is 12*7?"},
        {
            "role": "assistant",
            "content": [
                {"type": "python", "text": "12*7"},
                {"type": "python_output", "text": "84"},
                {"type": "text", "text": "It is 84."},
            ],
        },
    ]
    ids, mask = tok.render_conversation(conversation)
    q, e, a = tok.encode("What is 12*7?"), tok.encode("12*7"), tok.encode("It is 84.")
    out = tok.encode("84")
    want = [
        (s("<|bos|>"), 0), (s("<|user_start|>"), 0), *[(i, 0) for i in q], (s("<|user_end|>"), 0),
        (s("<|assistant_start|>"), 0), (s("<|python_start|>"), 1), *[(i, 1) for i in e],
        (s("<|python_end|>"), 1), (s("<|output_start|>"), 0), *[(i, 0) for i in out],
        (s("<|output_end|>"), 0), *[(i, 1) for i in a], (s("<|assistant_end|>"), 1),
    ]  # fmt: skip
    assert list(zip(ids, mask, strict=True)) == want


def test_render_for_completion_merges_the_system_prompt_and_ends_ready_to_answer(tok):
    with_system = tok.render_for_completion(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    merged = tok.render_for_completion([{"role": "user", "content": "Be brief.\n\nhi"}])
    assert with_system == merged
    assert with_system[-1] == tok.encode_special("<|assistant_start|>")


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "hi"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "x"}]}],
    ],
)
def test_malformed_conversations_are_refused(tok, messages):
    with pytest.raises(TokenizerError):
        tok.render_conversation(messages)


def test_save_and_load_round_trip(tok, tmp_path):
    tok.save(tmp_path / "tokenizer.pkl")
    again = Tokenizer.from_file(tmp_path / "tokenizer.pkl")
    text = "Counting r's in strawberry: 1,234 * 56"
    assert again.encode(text) == tok.encode(text)


def test_from_ranks_appends_the_specials_last():
    ranks = {bytes([i]): i for i in range(256)}
    tok = Tokenizer.from_ranks(ranks)
    assert tok.get_vocab_size() == 265 and tok.encode_special("<|output_end|>") == 264


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"not a pickle", "corrupt or truncated"),
        (pickle.dumps({"name": "x"}), "does not hold a tiktoken Encoding"),
        (pickle.dumps(print), "Refused to load tokenizer"),
    ],
)
def test_bad_tokenizer_files_say_what_is_wrong(tmp_path, payload, message):
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(payload)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_file(path)


def test_hostile_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(TokenizerError, match=r"refused to load global pathlib"):
        Tokenizer.from_file(path)
    assert not marker.exists()


def test_a_tokenizer_pkl_that_gives_an_id_twice_is_refused_not_a_panic(tmp_path):
    # Found by the fuzzer: tiktoken's Rust core panics on it, past any `except Exception`.
    from chatcli.model.tokenizer import SPLIT_PATTERN

    ranks = {bytes([i]): i for i in range(256)} | {b"ab": 7}
    state = {
        "name": "twice",
        "pat_str": SPLIT_PATTERN,
        "mergeable_ranks": ranks,
        "special_tokens": {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)},
    }
    # As tiktoken pickles an Encoding: NEWOBJ(tiktoken.core.Encoding), BUILD(state).
    body = pickle.dumps(state, protocol=3)[2:-1]
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(b"\x80\x03ctiktoken.core\nEncoding\n)\x81" + body + b"b.")
    with pytest.raises(TokenizerError, match="gives the id 7 to more than one token"):
        Tokenizer.from_file(path)


def test_a_tokenizer_pkl_that_names_a_huge_memo_index_is_refused_before_memory_is_taken(tmp_path):
    # Found by atheris: 9 KB whose LONG_BINPUT named index 1124176973 made the unpickler take
    # 17 GB. Here 2**26 (512 MB, were it taken).
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(b"\x80\x02Nr" + (2**26).to_bytes(4, "little") + b".")
    with pytest.raises(TokenizerError, match=r"a memo index \(67108864\) past anything"):
        Tokenizer.from_file(path)
