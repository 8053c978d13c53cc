"""The plugin file as a command: subprocess runs against mock and a loopback endpoint."""

import os

import pytest

import support

BENCH = ("featherweight_v1.jsonl", "featherweight_v2.jsonl", "programming_v1.jsonl")


def check(proc, code):
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert proc.stderr == ""
    assert "Traceback" not in proc.stdout
    return proc.stdout


def test_run_example_against_mock(plugins):
    out = check(support.run_standalone(plugins, "run", "example", "--server", "mock"), 0)
    assert "Score: " in out and "saved: " in out
    [path] = support.results(plugins)
    result = support.read_json(path)
    assert (result["model"], result["endpoint"], result["total"]) == ("mock", "mock", 5)
    assert (plugins / "evaluator" / "tests" / "example.jsonl").is_file()


def test_mock_is_deterministic_and_near_chance(plugins):
    support.copy_benchmark(plugins, "featherweight_v2.jsonl")
    scores = []
    for _ in range(2):
        check(support.run_standalone(plugins, "run", "featherweight_v2", "--server", "mock"), 0)
        scores.append(support.read_json(max(support.results(plugins), key=os.path.getmtime)))
    assert [d["raw_response"] for d in scores[0]["details"]] == [d["raw_response"] for d in scores[1]["details"]]
    assert scores[0]["parse_errors"] == 0
    assert 0.15 <= scores[0]["accuracy"] <= 0.35


@pytest.mark.parametrize("args", [["help"], [], ["--help"], ["list"], ["info", "example"], ["results"],
                                  ["results", "example"]])
def test_read_only_subcommands_exit_zero(plugins, args):
    out = check(support.run_standalone(plugins, *args), 0)
    assert out


def test_help_shows_the_standalone_flags(plugins):
    out = check(support.run_standalone(plugins, "help"), 0)
    assert "--server" in out and "--fail-under" in out and "--timeout" in out


@pytest.mark.parametrize("args, message", [
    (["run"], "run needs a test name"),
    (["run", "example", "--limit", "0"], "--limit must be at least 1"),
    (["run", "example", "--timeout", "0"], "--timeout must be a finite number above 0"),
    (["run", "example", "--fail-under", "101"], "--fail-under must be a finite number"),
    (["run", "example", "--server"], "--server needs a value"),
    (["bogus"], "unknown subcommand 'bogus'"),
    (["run", "nosuch", "--server", "mock"], "no test nosuch"),
    (["run", "example", "--server", "ftp://example.org"], "only http and https"),
    (["run", "example", "--server", "http://"], "has no host name"),
    (["run", "example", "--server", "localhost:port"], "bad port"),
])
def test_usage_errors_exit_two(plugins, args, message):
    out = check(support.run_standalone(plugins, *args), 2)
    assert message in out


def test_broken_test_file_exits_two(plugins):
    support.add_test(plugins, "bad.jsonl", ['{"question": "Q", "choices": [1, 2], "answer": "A"}'])
    out = check(support.run_standalone(plugins, "run", "bad", "--server", "mock"), 2)
    assert "bad.jsonl:1: choice A is a number (1), not a string; choice B is a number (2)" in out


def test_loopback_endpoint_request_shape(plugins, endpoints):
    endpoint = endpoints(lambda body, n: "B")
    check(support.run_standalone(plugins, "run", "example", "--server", endpoint.url, "--limit", "2"), 0)
    assert len(endpoint.requests) == 2
    body = endpoint.requests[0]
    assert body["history"] == [{"role": "user", "content": body["history"][0]["content"]}]
    assert (body["temperature"], body["top_k"], body["max_new_tokens"]) == (0.0, 1, 20)
    headers = {k.lower(): v for k, v in endpoint.headers[0].items()}
    assert headers["content-type"] == "application/json"
    assert headers["user-agent"].startswith("Mozilla/5.0")
    result = support.read_json(support.results(plugins)[0])
    assert result["model"] == "h2o8_preview_01" and result["endpoint"] == endpoint.url


@pytest.mark.parametrize("form", ["{url}/api/chat", "{url}/api/health", "{host}", "{url}/router.php"])
def test_url_forms(plugins, endpoints, form):
    endpoint = endpoints(lambda body, n: "C")
    server = form.format(url=endpoint.url, host=endpoint.url[len("http://"):])
    check(support.run_standalone(plugins, "run", "example", "--server", server, "--limit", "1"), 0)
    assert len(endpoint.requests) == 1
    assert support.read_json(support.results(plugins)[0])["model"] == "h2o8_preview_01"


def test_fail_under(plugins, endpoints):
    check(support.run_standalone(plugins, "list"), 0)     # seeds the example
    key = support.answer_key(str(plugins / "evaluator" / "tests" / "example.jsonl"))
    endpoint = endpoints(lambda body, n: key[support.question_of(body)] if n % 5 else "Z")
    check(support.run_standalone(plugins, "run", "example", "--server", endpoint.url, "--fail-under", "80"), 0)
    out = check(support.run_standalone(plugins, "run", "example", "--server", endpoint.url,
                                       "--fail-under", "80.1"), 1)
    assert "accuracy 80.0% is below --fail-under 80.1%" in out
    check(support.run_standalone(plugins, "run-all", "--server", endpoint.url, "--fail-under", "90"), 1)


def test_unreachable_port_exits_three(plugins):
    url = "http://127.0.0.1:%d" % support.free_port()
    out = check(support.run_standalone(plugins, "run", "example", "--server", url, "--retries", "0"), 3)
    assert "Stopped: endpoint failing since question geo1: network error" in out
    result = support.read_json(support.results(plugins)[0])
    assert result["interrupted"] is True and result["request_errors"] == 5 and result["total"] == 0


def test_html_answering_server_exits_three(plugins, endpoints):
    endpoint = endpoints(lambda body, n: support.Reply(raw=b"<html>hi</html>", content_type="text/html"))
    out = check(support.run_standalone(plugins, "run", "example", "--server", endpoint.url,
                                       "--retries", "0"), 3)
    assert "response is not JSON" in out
    assert len(endpoint.requests) == 5


def test_shared_benchmarks_end_to_end(plugins, endpoints):
    key = {}
    for name in BENCH:
        support.copy_benchmark(plugins, name)
        key.update(support.answer_key(support.benchmark(name)))
    endpoint = endpoints(lambda body, n: "Answer: %s" % key[support.question_of(body)])
    out = check(support.run_standalone(plugins, "run-all", "--server", endpoint.url, "--workers", "4"), 0)
    totals = {}
    for path in support.results(plugins):
        result = support.read_json(path)
        totals[result["test"]] = (result["total"], result["correct"], result["parse_errors"])
    assert totals == {"featherweight_v1": (100, 100, 0), "featherweight_v2": (300, 300, 0),
                      "programming_v1": (200, 200, 0)}
    assert "600/600" in out


def test_host_and_standalone_write_the_same_result(plugins, endpoints, capsys):
    replies = ["B", "The answer is C", "(a)", "Mercury", "hmm"]
    endpoint = endpoints(lambda body, n: replies[(n - 1) % 5])
    host = support.Host(str(plugins), lambda: support.OldContext(endpoint.url))
    host.dispatch("/eval run example")
    check(support.run_standalone(plugins, "run", "example", "--server", endpoint.url), 0)
    first, second = [support.read_json(p) for p in sorted(support.results(plugins), key=os.path.getmtime)]
    for field in ("timestamp", "elapsed_seconds"):
        first.pop(field), second.pop(field)
    assert first == second
    assert first["correct"] == 2


def test_no_traceback_for_odd_input(plugins):
    for args in (["run", "../../nowhere"], ["run", "/"], ["info", "--limit=2"], ["results", "a", "b"],
                 ["--server", "mock", "run-all", "--workers", "99"], ["run", "example", "--temp", "1e999"]):
        proc = support.run_standalone(plugins, *args)
        assert proc.returncode == 2, (args, proc.stdout)
        assert "Traceback" not in proc.stdout + proc.stderr


def test_a_reader_that_goes_away_stops_nothing(plugins):
    check(support.run_standalone(plugins, "list"), 0)
    proc = support.start_standalone(plugins, "run", "example", "--server", "mock", "--verbose",
                                    text=False)
    proc.stdout.close()                       # like `| head -0`
    err = proc.stderr.read()
    assert proc.wait() == 0 and err == b""
    assert support.read_json(support.results(plugins)[0])["total"] == 5
