"""The answer cascade, step by step, and where it follows a careful grader."""

import random

import pytest

import support

ev = support.load_module()

PLANETS = ["Venus", "Earth", "Mercury", "Mars"]
PLANET_Q = "Which planet is closest to the Sun?"
YEARS = ["194", "1945", "1948", "1950"]
WORDS = ["happy", "quickly", "run", "blue"]
TEN = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def read(reply, choices=PLANETS, question=PLANET_Q):
    prompt = ev.build_prompt({"question": question, "choices": choices})
    return ev.read_answer(reply, choices, question, prompt)


@pytest.mark.parametrize("reply, expected", [
    # (1) a parenthesised letter
    ("(C)", "C"),
    ("I think it is (C) Mercury", "C"),
    ("Not (E), so (B)", "B"),                 # out of range is skipped
    ("Since f(a) grows, pick (D)", "D"),      # f(a) is not a label
    ("Mars? No: (c)", "C"),
    # (2) "Answer: X" / "answer is X"
    ("Answer: C", "C"),
    ("The answer is b", "B"),
    ("I believe the answer is D.", "D"),
    ("**Answer:** C", "C"),
    ("The correct answer would be A", "A"),
    # (3) a reply that starts with a letter
    ("C) Mercury", "C"),
    ("C. Mercury", "C"),
    ("D: Mars", "D"),
    ("**B**", "B"),
    ("  b.  ", "B"),
    ("C", "C"),
    ("c", "C"),
    ("a", "A"),
    ("A", "A"),
    # (4) the text of a choice, earliest mention first
    ("Mercury", "C"),
    ("It's mercury, obviously", "C"),
    ("Mars is far away; Mercury is nearest", "D"),
    # (5) any standalone valid letter
    ("Probably B", "B"),
    ("I'm fairly sure it's D", "D"),
    ("My pick: C!", "C"),
    # (6) the first non-blank character
    ("B2", "B"),
    # nothing readable
    ("I don't know", None),
    ("E", None),
    ("(F)", None),
    ("", None),
    ("   ", None),
])
def test_cascade(reply, expected):
    assert read(reply) == expected


def test_earlier_steps_win_over_later_ones():
    assert read("Mars. Answer: (B)") == "B"          # 1 before 2 and 4
    assert read("Mars. The answer is B") == "B"       # 2 before 4
    assert read("C) but Earth is nice") == "C"        # 3 before 4
    assert read("Earth, or maybe C") == "B"           # 4 before 5


@pytest.mark.parametrize("reply, expected", [
    ("It ended in 1945", "B"),        # 194 never matches inside 1945
    ("194, I think", "A"),
    ("The year 19450", None),
])
def test_choice_text_respects_word_edges(reply, expected):
    assert read(reply, YEARS, "When did the war end?") == expected


def test_choice_text_whole_words_only():
    assert read("Running quickly", WORDS, "Which is a verb?") == "B"   # not run
    assert read("running", WORDS, "Which is a verb?") is None


@pytest.mark.parametrize("reply, expected", [
    # the article "a"
    ("A planet named Mercury", "C"),
    ("It is a tough one, but B", "B"),
    ("The answer is a planet: Mercury", "C"),
    ("A is correct", "A"),
    ("A or B, probably A", "A"),
    # contractions
    ("I'd go with B", "B"),
    ("It's D", "D"),
    # abbreviations and compounds
    ("e.g. Mars", "D"),
    ("My T-shirt says D", "D"),
    # a word that merely begins with a valid letter
    ("Because it is hot", None),
    ("Definitely", None),
])
def test_prose_letters_are_not_labels(reply, expected):
    assert read(reply) == expected


@pytest.mark.parametrize("reply, expected", [
    ("I choose J", "J"),
    ("I think the answer is I", "I"),
    ("I", "I"),
    ("I would say J", "J"),
    ("I is correct", "I"),
])
def test_pronoun_i_with_nine_or_more_choices(reply, expected):
    assert read(reply, TEN, "Which number is largest?") == expected


def test_echo_of_the_question_is_no_answer():
    assert read(PLANET_Q) is None
    assert read("Which planet is closest to the") is None        # cut short


def test_listing_the_options_back_is_no_answer():
    assert read("A) Venus\nB) Earth\nC) Mercury\nD) Mars") is None
    assert read("A) Venus B) Earth C) Merc") is None             # cut short
    assert read("A. Venus, B. Earth") is None


def test_echoed_prompt_then_an_answer_reads_the_answer():
    prompt = ev.build_prompt({"question": PLANET_Q, "choices": PLANETS})
    assert read(prompt + "\n\nC") == "C"
    assert read(prompt[:45]) is None
    assert read(PLANET_Q + " Mercury") == "C"
    assert read(PLANET_Q + "\nAnswer: D") == "D"
    assert read("A) Venus\nB) Earth\nC) Mercury\nD) Mars\nAnswer: C") == "C"


def test_a_single_option_with_its_text_is_an_answer():
    assert read("B) Earth") == "B"
    assert read("B) Earth, not A) Venus") == "B"


def test_short_question_starting_with_a_letter_is_not_an_echo():
    assert read("A", ["x", "y"], "A or B?") == "A"


def test_only_letters_in_range_count():
    assert read("(C)", ["yes", "no"], "Is it?") is None
    assert read("Z", ["yes", "no"], "Is it?") is None
    assert read("B", ["yes", "no"], "Is it?") == "B"


def test_replies_in_other_scripts_and_huge_replies():
    assert read("Ответ: C") == "C"
    assert read("答案是 (B)") == "B"
    assert read("Mercury " + "blah " * 400000) == "C"


def test_terminal_codes_around_a_letter_are_ignored():
    assert read("\x1b[1mB\x1b[0m") == "B"
    assert read("\x1b]0;title\x07C") == "C"


def test_choice_text_in_scripts_without_spaces():
    assert read("東京です", ["大阪", "東京"], "日本の首都は?") == "B"


@pytest.mark.parametrize("reply, expected", [
    ("Not A, but B", "B"),
    ("The answer is not (A); it is (D)", "D"),
    ("It's not Venus, it's Mercury", "C"),
    ("Definitely not option C. D", "D"),
    ("It isn't A", None),
])
def test_negated_letters_and_choices_do_not_count(reply, expected):
    assert read(reply) == expected


def test_answer_then_the_rest_of_the_list_is_still_an_answer():
    assert read("C) Mercury\nD) Mars") == "C"


def test_quoted_letter_after_answer():
    assert read('The answer is "D".') == "D"
    assert read("answer: `B`") == "B"


@pytest.mark.parametrize("reply, expected", [
    ("The correct option is b", "B"),
    ("I'd pick choice d here", "D"),
    ("Option a because Venus is hot", "A"),
    ("The letter C.", "C"),
])
def test_option_choice_and_letter_phrases(reply, expected):
    assert read(reply) == expected


def test_any_reply_gives_a_valid_letter_or_none():
    rng = random.Random(7)
    pieces = list("abcABCIi ()[].:;,'\"-*_\n\t\x1b\x07é東0129") + [
        "Answer", "answer is", "not ", "option ", " A) ", "I'd ", "\u202e"]
    for _ in range(2000):
        count = rng.randint(2, 26)
        choices = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 5))) for _ in range(count)]
        question = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 20)))
        prompt = ev.build_prompt({"question": question, "choices": choices})
        reply = prompt[:rng.randint(0, len(prompt))] * (rng.random() < 0.3) + "".join(
            rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        letter = ev.read_answer(reply, choices, question, prompt)
        assert letter is None or letter in ev.LETTERS[:count]
