"""Loading and validating test files: every rule, with file, line and reason."""

import io

import pytest

import support

ev = support.load_module()

GOOD = {"question": "Q?", "choices": ["x", "y", "z"], "answer": "B"}


def parse(lines, raw=None):
    data = raw if raw is not None else "".join(l + "\n" for l in lines).encode("utf-8")
    return ev.parse_test(io.BytesIO(data), "t.jsonl")


def problems(lines, raw=None):
    with pytest.raises(ev.TestFileError) as caught:
        parse(lines, raw)
    return caught.value.problems


def one_line(obj):
    return problems([support.json.dumps(obj)])


@pytest.mark.parametrize("change, reason", [
    ({"question": None}, "missing 'question'"),
    ({"question": ""}, "'question' must be a non-empty string"),
    ({"question": 5}, "'question' must be a non-empty string"),
    ({"choices": None}, "missing 'choices'"),
    ({"choices": "x,y"}, "'choices' must be a list of strings, not a string"),
    ({"choices": ["x"]}, "'choices' has 1 items; 2 to 26 are allowed"),
    ({"choices": ["c%d" % i for i in range(27)]}, "'choices' has 27 items"),
    ({"choices": ["x", None]}, "choice B is null, not a string"),
    ({"choices": ["x", 3]}, "choice B is a number (3), not a string"),
    ({"choices": ["x", float("nan")]}, "choice B is NaN, not a string"),
    ({"choices": [["x"], "y"]}, "choice A is a list, not a string"),
    ({"answer": "D"}, "'answer' \"D\" is out of range (A-C for 3 choices)"),
    ({"answer": "BB"}, "'answer' \"BB\" is not a letter (A-C)"),
    ({"answer": 3}, "'answer' index 3 is out of range (0-2 for 3 choices)"),
    ({"answer": -1}, "'answer' index -1 is out of range"),
    ({"answer": True}, "not a boolean (true)"),
    ({"answer": 1.0}, "not a number (1.0)"),
    ({"answer": None}, "not null"),
    ({"id": ["a"]}, "'id' must be a non-empty string or an integer"),
    ({"category": 7}, "'category' must be a non-empty string"),
])
def test_each_field_rule_names_file_line_and_reason(change, reason):
    obj = dict(GOOD)
    obj.update(change)
    if change.get("question", "") is None:
        del obj["question"]
    if "choices" in change and change["choices"] is None:
        del obj["choices"]
    found = one_line(obj)
    assert len(found) == 1
    assert found[0].startswith("t.jsonl:1: ")
    assert reason in found[0]


def test_missing_answer():
    obj = dict(GOOD)
    del obj["answer"]
    assert one_line(obj) == ["t.jsonl:1: missing 'answer'"]


@pytest.mark.parametrize("answer, letter", [
    ("b", "B"), ("(B)", "B"), ("B.", "B"), (" c ", "C"), (0, "A"), (2, "C"), ("(c)", "C")])
def test_answer_forms(answer, letter):
    obj = dict(GOOD, answer=answer)
    meta, questions = parse([support.json.dumps(obj)])
    assert questions[0]["answer"] == letter


def test_every_bad_line_is_reported_in_one_pass():
    lines = ['{"_meta": true, "name": "T"}', support.json.dumps(GOOD), "{oops",
             "[1, 2]", support.json.dumps(dict(GOOD, answer="Z")), support.json.dumps(GOOD)]
    found = problems(lines)
    assert [p.split(": ", 1)[0] for p in found] == ["t.jsonl:3", "t.jsonl:4", "t.jsonl:5"]
    assert "invalid JSON" in found[0]
    assert "expected a JSON object, found a list" in found[1]


def test_problem_list_is_capped():
    found = problems(["{bad"] * 50)
    assert len(found) == ev.MAX_REPORTED_PROBLEMS + 1
    assert found[-1] == "... and 30 more bad lines"


def test_bom_crlf_and_blank_lines_are_fine():
    raw = b"\xef\xbb\xbf" + b'{"_meta": true, "name": "Bom"}\r\n\r\n' + \
        support.json.dumps(GOOD).encode() + b"\r\n\r\n   \r\n" + support.json.dumps(GOOD).encode()
    meta, questions = parse(None, raw)
    assert meta["name"] == "Bom"
    assert len(questions) == 2
    assert [q["id"] for q in questions] == ["q1", "q2"]


def test_not_utf8_names_the_line():
    raw = support.json.dumps(GOOD).encode() + b"\n" + b'{"question": "caf\xe9"}\n' + \
        support.json.dumps(GOOD).encode() + b"\n\xff\n"
    assert problems(None, raw) == ["t.jsonl:2: not UTF-8 text (byte 0xe9)",
                                   "t.jsonl:4: not UTF-8 text (byte 0xff)"]


def test_empty_file_and_header_only():
    assert problems([], b"") == ["t.jsonl:1: no questions (the file is empty)"]
    assert problems(["", "   "]) == ["t.jsonl:1: no questions (the file is empty)"]
    assert problems(['{"_meta": true, "name": "x"}']) == [
        "t.jsonl:1: no questions after the _meta header"]


def test_header_only_on_the_first_line():
    found = problems([support.json.dumps(GOOD), '{"_meta": true}'])
    assert found == ["t.jsonl:2: a _meta header is only allowed on the first line"]


def test_header_fields_must_be_strings():
    found = problems(['{"_meta": true, "name": 3}', support.json.dumps(GOOD)])
    assert found == ["t.jsonl:1: _meta 'name' must be a string, not a number (3)"]


def test_the_shared_multiple_choice_benchmarks_load():
    counts = {}
    for name in ("featherweight_v1.jsonl", "featherweight_v2.jsonl", "programming_v1.jsonl"):
        test = ev.load_test(support.benchmark(name))
        counts[name] = (len(test.questions), len({q["category"] for q in test.questions}))
        assert all(q["answer"] in "ABCD" for q in test.questions)
    assert counts == {"featherweight_v1.jsonl": (100, 10), "featherweight_v2.jsonl": (300, 10),
                      "programming_v1.jsonl": (200, 1)}


def test_the_checks_benchmark_is_refused_with_a_line_numbered_reason():
    with pytest.raises(ev.TestFileError) as caught:
        ev.load_test(support.benchmark("chatbotgym_checks.jsonl"))
    assert caught.value.problems == [
        "chatbotgym_checks.jsonl:1: test_format \"checks\" is not supported: Evaluator runs "
        "multiple-choice tests, and these questions have no 'choices'"]


def test_a_file_that_cannot_be_read(tmp_path):
    with pytest.raises(ev.TestFileError) as caught:
        ev.load_test(str(tmp_path / "absent.jsonl"))
    assert caught.value.problems[0].startswith("absent.jsonl: cannot read it")


def test_a_large_file_loads(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(str(path), "w") as handle:
        for i in range(100000):
            handle.write(support.json.dumps(dict(GOOD, id=i)) + "\n")
    test = ev.load_test(str(path))
    assert len(test.questions) == 100000
    assert test.questions[-1]["id"] == "99999"
