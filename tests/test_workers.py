"""Many questions in flight: the same results as one at a time, and Ctrl-C still safe."""

import os
import signal

import support
from support import Reply

BENCH = ("featherweight_v1.jsonl", "featherweight_v2.jsonl", "programming_v1.jsonl")
STYLES = ("{L}", "Answer: {L}", "({L})", "hmm", "I'd go with {L}", "{L}) something")


def varied_script(key):
    """Right, wrong and unreadable replies, decided by the question alone."""
    def script(body, n):
        question = support.question_of(body)
        digest = sum(map(ord, question))
        letter = key[question] if digest % 3 else "ABCD"[digest % 4]
        return STYLES[digest % len(STYLES)].format(L=letter)
    return script


def run_host(plugins, endpoint, line):
    host = support.Host(str(plugins), lambda: support.NewContext(endpoint.url))
    host.dispatch(line)
    assert host.errors == []
    path = max(support.results(plugins), key=os.path.getmtime)
    result = support.read_json(path)
    os.unlink(str(path))
    for field in ("timestamp", "elapsed_seconds"):
        del result[field]
    return result


def test_workers_give_the_same_results_on_the_shared_benchmarks(plugins, endpoints):
    for name in BENCH:
        support.copy_benchmark(plugins, name)
        key = support.answer_key(support.benchmark(name))
        endpoint = endpoints(varied_script(key))
        base = name[:-6]
        one = run_host(plugins, endpoint, "/eval run %s" % base)
        eight = run_host(plugins, endpoint, "/eval run %s --workers 8" % base)
        assert one == eight
        assert 0 < one["correct"] < one["total"] and one["parse_errors"] > 0


def test_failures_under_concurrency_change_nothing(plugins, endpoints):
    support.copy_benchmark(plugins, "featherweight_v1.jsonl")
    key = support.answer_key(support.benchmark("featherweight_v1.jsonl"))
    clean = varied_script(key)
    endpoint = endpoints(clean)
    reference = run_host(plugins, endpoint, "/eval run featherweight_v1")
    attempts = {}

    def flaky_script(body, n):    # some questions fail once or twice, then succeed
        question = support.question_of(body)
        attempts[question] = attempts.get(question, 0) + 1
        if attempts[question] <= sum(map(ord, question)) % 5 - 2:
            return Reply(500, body={})
        return clean(body, n)
    endpoint.script = flaky_script
    endpoint.requests[:] = []
    flaky = run_host(plugins, endpoint, "/eval run featherweight_v1 --workers 8")
    assert flaky == reference and flaky["request_errors"] == 0
    assert len(endpoint.requests) > 100 + 20


def test_limit_means_the_first_questions(plugins, endpoints):
    endpoint = endpoints(lambda body, n: "B")
    result = run_host(plugins, endpoint, "/eval run example --limit 3 --workers 8")
    assert [d["id"] for d in result["details"]] == ["geo1", "math1", "sci1"]
    assert len(endpoint.requests) == 3


def test_verbose_prints_one_line_per_question(plugins, endpoints, capsys):
    support.copy_benchmark(plugins, "featherweight_v1.jsonl")
    endpoint = endpoints(lambda body, n: "C")
    host = support.Host(str(plugins), lambda: support.NewContext(endpoint.url))
    capsys.readouterr()
    host.dispatch("/eval run featherweight_v1 --workers 8 --verbose")
    lines = [l for l in capsys.readouterr().out.splitlines() if "expected" in l]
    assert len(lines) == 100
    assert len({l.split()[1] for l in lines}) == 100


def test_ctrl_c_with_workers_keeps_every_received_answer(plugins, endpoints, capsys):
    support.copy_benchmark(plugins, "featherweight_v1.jsonl")
    answered, workers = 20, 8

    def script(body, n):
        if n <= answered:
            return "A"
        if n == answered + workers:    # every worker now waits on a request that hangs
            os.kill(os.getpid(), signal.SIGINT)
        return Reply(hang=120)
    endpoint = endpoints(script)
    host = support.Host(str(plugins), lambda: support.NewContext(endpoint.url))
    capsys.readouterr()
    host.dispatch("/eval run featherweight_v1 --workers %d" % workers)
    assert host.errors == []
    out = capsys.readouterr().out
    assert "Interrupted after 20 of 100 questions" in out
    result = support.read_json(support.results(plugins)[0])
    assert result["interrupted"] is True and result["total"] == answered
    assert len(endpoint.requests) == answered + workers
    assert len(support.journals(plugins)) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
