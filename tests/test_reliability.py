"""Nothing lost: failed requests, outages, crashes, Ctrl-C and hostile content."""

import json
import os
import re
import resource
import signal
import subprocess
import threading

import pytest

import support
from support import Reply

FAULTS = {
    "HTTP 500": (Reply(500, body={"error": "CUDA out of memory"}),
                 "HTTP 500 Internal Server Error: CUDA out of memory"),
    "HTTP 412 HTML": (Reply(412, raw=b"<html>firewall</html>", content_type="text/html"), "HTTP 412"),
    "not JSON": (Reply(raw=b"<html>ok</html>", content_type="text/html"), "response is not JSON"),
    "error body": (Reply(body={"error": "model overloaded"}), "server error: model overloaded"),
    "empty reply": (Reply(body={"reply": "  "}), "empty reply"),
    "non-string reply": (Reply(body={"reply": ["B"]}), "reply is not a string"),
    "reset": (Reply(reset=True), "network error"),
    "hang": (Reply(hang=30), "timed out after 1s"),
}


def scripted(fail_on, fault, answer="B"):
    """Replies ``answer``, except with ``fault`` on the request numbers in ``fail_on``."""
    return lambda body, n: fault if n in fail_on else answer


def standalone(plugins, endpoint, *args):
    proc = support.run_standalone(plugins, "run", "example", "--server", endpoint.url,
                                  "--timeout", "1", *args)
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


def newest(plugins):
    return support.read_json(max(support.results(plugins), key=os.path.getmtime))


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_fault_that_clears_on_retry_costs_nothing(plugins, endpoints, name):
    endpoint = endpoints(scripted({2}, FAULTS[name][0]))
    proc = standalone(plugins, endpoint)
    assert proc.returncode == 0, proc.stdout
    result = newest(plugins)
    assert (result["total"], result["request_errors"], result["correct"]) == (5, 0, 2)
    assert len(endpoint.requests) == 6
    assert not any("error" in d for d in result["details"])


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_fault_that_persists_is_a_request_error_not_an_answer(plugins, endpoints, name):
    fault, reason = FAULTS[name]
    endpoint = endpoints(scripted({2, 3, 4}, fault))
    proc = standalone(plugins, endpoint)
    assert proc.returncode == 0, proc.stdout
    result = newest(plugins)
    assert (result["total"], result["answered"], result["request_errors"], result["parse_errors"]) == (4, 4, 1, 0)
    assert result["accuracy"] == pytest.approx(0.5)     # geo1 and hist1 are B; math1 is left out
    failed = result["details"][1]
    assert failed["id"] == "math1" and failed["raw_response"] is None and failed["predicted"] is None
    assert failed["error"].startswith(reason)
    assert "request errors: 1 (not scored)" in proc.stdout
    assert len(endpoint.requests) == 7


def test_retries_flag(plugins, endpoints):
    endpoint = endpoints(scripted({1, 2, 3}, FAULTS["HTTP 500"][0]))
    proc = standalone(plugins, endpoint, "--retries", "3")
    assert proc.returncode == 0
    assert newest(plugins)["request_errors"] == 0
    assert len(endpoint.requests) == 8
    endpoint.requests[:] = []
    endpoint.script = scripted({1}, FAULTS["HTTP 500"][0])
    standalone(plugins, endpoint, "--retries", "0")
    assert newest(plugins)["request_errors"] == 1 and len(endpoint.requests) == 5


def test_host_failures_are_retried_and_reported(plugins, endpoints, capsys):
    endpoint = endpoints(scripted({1, 2, 3, 5}, FAULTS["HTTP 500"][0]))
    host = support.Host(str(plugins), lambda: support.NewContext(endpoint.url))
    host.dispatch("/eval run example")
    result = support.read_json(support.results(plugins)[0])
    assert result["details"][0]["error"] == "request failed"
    assert (result["total"], result["request_errors"]) == (4, 1)
    assert len(endpoint.requests) == 8
    out = capsys.readouterr().out
    assert "request errors: 1" in out
    host.dispatch("/eval results example")
    assert "request errors: 1 (not scored)" in capsys.readouterr().out


def test_outage_stops_the_run_and_saves(plugins, endpoints):
    support.copy_benchmark(plugins, "featherweight_v1.jsonl")
    endpoint = endpoints(lambda body, n: "A" if n <= 10 else FAULTS["HTTP 500"][0])
    proc = support.run_standalone(plugins, "run", "featherweight_v1", "--server", endpoint.url)
    assert proc.returncode == 3
    assert "Stopped: endpoint failing since question hist01: HTTP 500" in proc.stdout
    assert endpoint.url in proc.stdout
    assert len(endpoint.requests) == 10 + 5 * 3
    result = newest(plugins)
    assert result["interrupted"] is True and "HTTP 500" in result["stop_reason"]
    assert (result["total"], result["request_errors"]) == (10, 5)
    assert len(support.journals(plugins)) == 1     # kept for --resume


# ---- journal and resume --------------------------------------------------

class Gate(object):
    """An endpoint that answers from a key until a chosen request, then hangs."""

    def __init__(self, endpoints, key):
        self.key, self.stop_at = key, None
        self.reached = threading.Event()
        self.endpoint = endpoints(self.script)

    def script(self, body, n):
        if self.stop_at is not None and n >= self.stop_at:
            self.reached.set()
            return Reply(hang=60)
        return self.key.get(support.question_of(body), "Z")


def start(plugins, url, *args):
    return support.start_standalone(plugins, "run", "featherweight_v1", "--server", url, *args)


def without_timing(result):
    return {k: v for k, v in result.items() if k not in ("timestamp", "elapsed_seconds")}


@pytest.fixture
def gate(plugins, endpoints):
    support.copy_benchmark(plugins, "featherweight_v1.jsonl")
    key = support.answer_key(support.benchmark("featherweight_v1.jsonl"))
    for i, question in enumerate(sorted(key)):
        if i % 3 == 0:
            key[question] = "I cannot say"
    return Gate(endpoints, key)


def full_run(plugins, gate):
    proc = support.run_standalone(plugins, "run", "featherweight_v1", "--server", gate.endpoint.url)
    assert proc.returncode == 0
    path = max(support.results(plugins), key=os.path.getmtime)
    result = support.read_json(path)
    os.unlink(str(path))
    return result


def test_sigkill_then_resume_asks_only_the_missing(plugins, gate):
    reference = full_run(plugins, gate)
    gate.endpoint.requests[:] = []
    gate.stop_at = 41
    proc = start(plugins, gate.endpoint.url)
    assert gate.reached.wait(60)
    proc.kill()
    proc.communicate()
    [journal] = support.journals(plugins)
    lines = journal.read_text().splitlines()
    assert len(lines) == 41 and json.loads(lines[0])["test"] == "featherweight_v1"
    with open(str(journal), "a") as handle:
        handle.write('{"index": 40, "detail": {"id": "hal')      # a torn last line
    asked_before = set(gate.endpoint.questions_asked()[:40])
    gate.stop_at, gate.endpoint.requests[:] = None, []
    out = support.run_standalone(plugins, "run", "featherweight_v1", "--server", gate.endpoint.url, "--resume")
    assert out.returncode == 0, out.stdout
    assert "Resuming featherweight_v1_" in out.stdout and "40 of 100 questions already answered" in out.stdout
    asked_now = gate.endpoint.questions_asked()
    assert len(asked_now) == 60 and not asked_before & set(asked_now)
    assert support.journals(plugins) == []
    assert without_timing(newest(plugins)) == without_timing(reference)


def test_sigint_saves_partial_and_resume_completes(plugins, gate):
    reference = full_run(plugins, gate)
    gate.stop_at, gate.endpoint.requests[:] = 21, []
    proc = start(plugins, gate.endpoint.url, "--workers", "3")
    assert gate.reached.wait(60)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err == "" and "Traceback" not in out
    assert re.search(r"Interrupted after (18|19|20) of 100 questions", out)
    partial = newest(plugins)
    assert partial["interrupted"] is True and partial["stop_reason"] == "interrupted (Ctrl-C)"
    [journal] = support.journals(plugins)
    journaled = len(journal.read_text().splitlines()) - 1
    assert 20 - 2 <= journaled <= len(partial["details"]) <= 20   # 3 workers: 18 to 20 back
    gate.stop_at, gate.endpoint.requests[:] = None, []
    done = support.run_standalone(plugins, "run", "featherweight_v1", "--server", gate.endpoint.url,
                                  "--resume", "--workers", "3")
    assert done.returncode == 0
    assert len(gate.endpoint.requests) == 100 - journaled
    assert without_timing(newest(plugins)) == without_timing(reference)


def test_repeated_sigint_during_the_save_never_corrupts(plugins, gate):
    gate.stop_at = 31
    proc = start(plugins, gate.endpoint.url)
    assert gate.reached.wait(60)
    while proc.poll() is None:     # keep pressing Ctrl-C until the process is gone
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(0.001)
        except subprocess.TimeoutExpired:
            pass
    proc.communicate()
    assert proc.returncode == 130
    files = support.results(plugins)
    for path in files:
        assert support.read_json(path)["interrupted"] is True
    assert not [n for n in os.listdir(str(plugins / "evaluator" / "results")) if n.endswith(".tmp")]


def test_a_new_run_mentions_the_unfinished_one(plugins, gate):
    gate.stop_at = 11
    proc = start(plugins, gate.endpoint.url)
    assert gate.reached.wait(60)
    proc.kill()
    proc.communicate()
    gate.stop_at = None
    out = support.run_standalone(plugins, "run", "featherweight_v1", "--server", gate.endpoint.url,
                                 "--limit", "5")
    assert "an unfinished run of featherweight_v1 exists" in out.stdout and "--resume" in out.stdout
    out = support.run_standalone(plugins, "run", "featherweight_v1", "--server", gate.endpoint.url,
                                 "--limit", "5", "--resume")
    assert "No unfinished run of featherweight_v1 with these settings" in out.stdout
    assert len(support.journals(plugins)) == 1      # the killed one, still resumable


def test_resume_in_the_host(plugins, endpoints, capsys):
    endpoint = endpoints(lambda body, n: "B")
    host = support.interrupting_host(plugins, endpoint, 3)
    host.dispatch("/eval run example")
    host.context_factory = lambda: support.NewContext(endpoint.url)
    endpoint.requests[:] = []
    host.dispatch("/eval run example --resume")
    assert len(endpoint.requests) == 3
    final = newest(plugins)
    assert (final["total"], final["interrupted"], [d["id"] for d in final["details"]]) == (
        5, False, ["geo1", "math1", "sci1", "lang1", "hist1"])
    assert support.journals(plugins) == []


# ---- result files -----------------------------------------------------------

def test_corrupt_result_files_are_listed_as_unreadable(host, capsys):
    folder = host.plugins_path / "evaluator" / "results"
    host.dispatch("/eval run example --limit 1")
    (folder / "empty.json").write_text("")
    (folder / "half.json").write_text('{"test": "example", "tot')
    (folder / "list.json").write_text("[1, 2]")
    (folder / "foreign.json").write_text('{"name": "something else"}')
    (folder / "edited.json").write_text('{"test": "example", "total": "five", "correct": 1, "answered": 1, "accuracy": 0.2}')
    (folder / "binary.json").write_bytes(b"\xff\xfe\x00")
    capsys.readouterr()
    host.dispatch("/eval results")
    out = capsys.readouterr().out
    assert host.errors == []
    for name, why in [("empty.json", "not valid JSON"), ("half.json", "not valid JSON"),
                      ("list.json", "not an Evaluator result"), ("foreign.json", "not an Evaluator result"),
                      ("edited.json", "field 'total'"), ("binary.json", "not valid JSON")]:
        assert re.search(r"  %s +unreadable: %s" % (re.escape(name), re.escape(why)), out)
    host.dispatch("/eval results example")
    out = capsys.readouterr().out
    assert "Score: 0/1" in out and host.errors == []


def test_unwritable_results_folder_keeps_the_answers(plugins, tmp_path):
    support.run_standalone(plugins, "list")
    results = plugins / "evaluator" / "results"
    results.rmdir()
    results.write_text("not a folder")
    fallback = tmp_path / "tmp"
    fallback.mkdir()
    proc = support.run_standalone(plugins, "run", "example", "--server", "mock",
                                  env={"TMPDIR": str(fallback)})
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr
    assert "cannot write a journal" in proc.stdout
    assert "Could not save to" in proc.stdout
    [saved] = os.listdir(str(fallback / "evaluator-results"))
    assert "saved: " + str(fallback / "evaluator-results" / saved) in proc.stdout
    assert support.read_json(fallback / "evaluator-results" / saved)["total"] == 5


# ---- hostile content -------------------------------------------------------------

HOSTILE = "\x1b[2J\x1b]0;pwned\x07\r\x9b31mB\u202e"


def test_control_characters_never_reach_the_terminal(plugins, endpoints):
    support.run_standalone(plugins, "list")
    support.add_test(plugins, "evil.jsonl", [
        {"_meta": True, "name": "Evil\x1b[31m", "description": "bell\x07"},
        {"id": "e\x1b1", "category": "c\x1b", "question": "Q\x1b[2J?", "choices": ["x\x07", "y"], "answer": "A"},
        {"id": "e2", "category": "d", "question": "Q2", "choices": ["x", "y"], "answer": "B"}])
    endpoint = endpoints(lambda body, n: HOSTILE)
    outputs = []
    for args in (["run", "evil", "--server", endpoint.url, "--verbose"], ["list"], ["info", "evil"],
                 ["results"], ["results", "evil"]):
        proc = support.run_standalone(plugins, *args)
        outputs.append(proc.stdout)
    text = "".join(outputs)
    for code in ("\x1b", "\x07", "\r", "\x9b", "\u202e"):
        assert code not in text
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in text or "Evil\\x1b[31m" in text
    result = newest(plugins)
    assert result["details"][0]["raw_response"] == HOSTILE
    assert result["details"][1]["predicted"] == "B"


def test_huge_reply_any_script_and_26_choices(plugins, endpoints):
    support.run_standalone(plugins, "list")
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    support.add_test(plugins, "wide.jsonl", [
        {"question": "Pick Z", "choices": ["opt %s" % c for c in letters], "answer": "Z"},
        {"question": "日本の首都は?", "choices": ["大阪", "東京"], "answer": "B"},
        {"question": "Huge", "choices": ["a", "b"], "answer": "B"}])
    replies = {"Pick Z": "Answer: Z", "日本の首都は?": "東京です", "Huge": "b " + "x" * (3 << 20)}
    endpoint = endpoints(lambda body, n: replies[support.question_of(body)])
    proc = support.run_standalone(plugins, "run", "wide", "--server", endpoint.url, "--verbose")
    assert proc.returncode == 0
    result = newest(plugins)
    assert [d["predicted"] for d in result["details"]] == ["Z", "B", "B"]
    assert len(result["details"][2]["raw_response"]) == 2 + (3 << 20)
    assert len(proc.stdout) < 10000


def test_resume_ignores_a_journal_of_a_changed_test(plugins, endpoints, capsys):
    endpoint = endpoints(lambda body, n: "B")
    host = support.interrupting_host(plugins, endpoint, 3)
    host.dispatch("/eval run example")
    example = plugins / "evaluator" / "tests" / "example.jsonl"
    example.write_text(example.read_text().replace("What is 7 x 8?", "What is 6 x 9?"))
    host.context_factory = lambda: support.NewContext(endpoint.url)
    capsys.readouterr()
    host.dispatch("/eval run example --resume")
    assert "No unfinished run of example with these settings" in capsys.readouterr().out
    assert newest(plugins)["total"] == 5


def test_a_full_disk_stops_the_journal_not_the_run(plugins, tmp_path):
    support.copy_benchmark(plugins, "featherweight_v1.jsonl")
    support.run_standalone(plugins, "list")
    fallback = tmp_path / "tmp"
    fallback.mkdir()

    def small_files():      # every file this process writes stops at 6,000 bytes
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))
    proc = support.run_standalone(plugins, "run", "featherweight_v1", "--server", "mock",
                                  env={"TMPDIR": str(fallback)}, preexec_fn=small_files)
    assert proc.stderr == "" and "Traceback" not in proc.stdout
    assert "warning: journal " in proc.stdout and "stopped" in proc.stdout
    assert "Could not save to" in proc.stdout and "Could not save a copy" in proc.stdout
    assert "Score: " in proc.stdout and "/100 (" in proc.stdout
    assert "The answers are still in the journal" in proc.stdout
    assert proc.returncode == 73
