"""The plugin inside a host built from HOST_CONTRACT.md, against a loopback endpoint."""

import io
import json
import os
import stat
import sys

import pytest

import support

EXAMPLE_KEY = {"What is the capital of France?": "B", "What is 7 x 8?": "C",
               "Which planet is closest to the Sun?": "Mercury",
               "Which of these words is a verb?": "I'd say (A)",
               "In which year did World War II end in Europe?": "blah"}


def run(host, line, capsys):
    capsys.readouterr()
    ctx = host.dispatch(line)
    out, err = capsys.readouterr()
    assert host.errors == []
    assert err == ""
    return out, ctx


def newest_result(host):
    files = support.results(host.plugins_path)
    assert files
    return support.read_json(max(files, key=os.path.getmtime))


# ---- identity and workspace ------------------------------------------------

def test_identity(host):
    assert len(host.plugins) == 1
    plugin = host.plugins[0]
    assert plugin.name == "evaluator"
    assert plugin.commands == ["/evaluator", "/eval"]
    assert plugin.description and "\n" not in plugin.description
    text = plugin.help_text()
    assert "run-all" in text and "--max-new" in text and "_meta" in text
    assert "--server" not in text


def test_module_is_not_in_sys_modules(host):
    assert "haiku_plugin_evaluator" not in sys.modules


def test_workspace_is_next_to_the_plugin_not_the_working_directory(plugins, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(str(elsewhere))
    support.Host(str(plugins), lambda: support.NewContext("http://127.0.0.1:9"))
    assert (plugins / "evaluator" / "tests" / "example.jsonl").is_file()
    assert (plugins / "evaluator" / "results").is_dir()
    assert os.listdir(str(elsewhere)) == []


def test_seeded_example(host):
    lines = (host.plugins_path / "evaluator" / "tests" / "example.jsonl").read_text().splitlines()
    meta = json.loads(lines[0])
    assert meta["_meta"] is True and meta["name"] == "Mini General Eval" and meta["description"]
    questions = [json.loads(l) for l in lines[1:]]
    assert [(q["id"], q["category"], q["answer"]) for q in questions] == [
        ("geo1", "geography", "B"), ("math1", "math", "C"), ("sci1", "science", "C"),
        ("lang1", "language", "C"), ("hist1", "history", "B")]
    assert questions[0]["choices"] == ["Berlin", "Paris", "Madrid", "Rome"]
    assert questions[2]["choices"] == ["Venus", "Earth", "Mercury", "Mars"]
    assert questions[4]["choices"] == ["1942", "1945", "1948", "1950"]


def test_seed_never_overwrites_and_reload_never_reseeds(host):
    tests = host.plugins_path / "evaluator" / "tests"
    (tests / "example.jsonl").write_text("edited\n")
    host.reload()
    assert (tests / "example.jsonl").read_text() == "edited\n"
    (tests / "example.jsonl").unlink()
    support.add_test(host.plugins_path, "mine.jsonl", [{"question": "Q", "choices": ["a", "b"], "answer": 0}])
    host.reload()
    assert sorted(os.listdir(str(tests))) == ["mine.jsonl"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores permissions")
def test_read_only_folder_warns(plugins, capsys):
    os.chmod(str(plugins), stat.S_IRUSR | stat.S_IXUSR)
    try:
        host = support.Host(str(plugins), lambda: support.NewContext("http://127.0.0.1:9"))
    finally:
        os.chmod(str(plugins), stat.S_IRWXU)
    assert host.errors == [] and len(host.plugins) == 1
    assert "warning" in capsys.readouterr().out


def test_unwritable_workspace_warns_and_host_lives(plugins, capsys):
    (plugins / "evaluator").write_text("a file where the folder should be")
    host = support.Host(str(plugins), lambda: support.NewContext("http://127.0.0.1:9"))
    assert host.errors == [] and len(host.plugins) == 1
    assert "[evaluator] warning: cannot prepare" in capsys.readouterr().out
    out, _ = run(host, "/eval list", capsys)
    assert "No tests" in out


# ---- commands ----------------------------------------------------------------

@pytest.mark.parametrize("line", ["/evaluator", "/evaluator help", "/eval help", "/eval"])
def test_help(host, line, capsys):
    out, _ = run(host, line, capsys)
    assert os.path.join("evaluator", "tests") in out
    assert os.path.join("evaluator", "results") in out
    assert '"choices"' in out and "run-all" in out


def test_unknown_subcommand_points_to_help(host, capsys):
    out, _ = run(host, "/eval frobnicate", capsys)
    assert "unknown subcommand 'frobnicate'" in out
    assert "/eval help" in out


def test_list(host, capsys):
    support.add_test(host.plugins_path, "b_broken.jsonl", ["{nope"])
    support.add_test(host.plugins_path, "a_plain.jsonl",
                     [{"question": "Q%d" % i, "choices": ["a", "b"], "answer": "A"} for i in range(3)])
    out, _ = run(host, "/eval list", capsys)
    rows = [l for l in out.splitlines() if l.startswith("  ")]
    assert rows[0].split()[:4] == ["a_plain.jsonl", "a_plain", "3", "questions"]
    assert rows[1].startswith("  b_broken.jsonl  error: b_broken.jsonl:1: invalid JSON")
    assert rows[2].split()[:6] == ["example.jsonl", "Mini", "General", "Eval", "5", "questions"]


def test_info(host, capsys):
    out, _ = run(host, "/eval info example", capsys)
    assert "name: Mini General Eval" in out
    assert "questions: 5" in out
    assert "categories: geography 1, math 1, science 1, language 1, history 1" in out
    assert "What is the capital of France?\n  A) Berlin\n  B) Paris\n  C) Madrid\n  D) Rome\n  answer: B" in out


def test_info_normalises_the_answer_letter(host, capsys):
    support.add_test(host.plugins_path, "idx.jsonl", [{"question": "Q", "choices": ["a", "b", "c"], "answer": 2}])
    out, _ = run(host, "/eval info idx.jsonl", capsys)
    assert "answer: C" in out


def test_info_of_a_broken_file_lists_every_problem(host, capsys):
    support.add_test(host.plugins_path, "bad.jsonl", ["{x", '{"question": "Q"}'])
    out, _ = run(host, "/eval info bad", capsys)
    assert "bad.jsonl:1: invalid JSON" in out
    assert "bad.jsonl:2: missing 'choices'; missing 'answer'" in out


def test_missing_test(host, capsys):
    out, _ = run(host, "/eval run nosuch", capsys)
    assert "no test nosuch" in out
    assert support.results(host.plugins_path) == []


# ---- running -------------------------------------------------------------------

def test_run_result_file_field_by_field(host, capsys):
    host.answers.update(EXAMPLE_KEY)
    out, ctx = run(host, "/eval run example", capsys)
    files = support.results(host.plugins_path)
    assert len(files) == 1
    assert files[0].name.startswith("example_") and len(files[0].stem) == len("example_20261130T001839")
    result = support.read_json(files[0])
    assert list(result)[:18] == [
        "test", "test_name", "model", "endpoint", "timestamp", "params", "prompt_template",
        "total", "answered", "correct", "incorrect", "parse_errors", "accuracy",
        "accuracy_parsed_only", "elapsed_seconds", "by_category", "interrupted", "request_errors"]
    assert result["test"] == "example"
    assert result["test_name"] == "Mini General Eval"
    assert result["model"] == "h2o8_preview_01"
    assert result["endpoint"] == host.endpoint.url
    assert result["timestamp"][:2] == "20" and "T" in result["timestamp"]
    assert result["params"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "max_new_tokens": 20,
                                "repetition_penalty": 1.0, "no_repeat_ngram": 0, "limit": None}
    assert result["prompt_template"] == (
        "{question}\n\n{choices_block}\n\nAnswer with just the letter of the correct choice.")
    # geo1 B right, math1 C right, sci1 "Mercury" right, lang1 (A) wrong, hist1 unparsed
    assert (result["total"], result["answered"], result["correct"], result["incorrect"],
            result["parse_errors"]) == (5, 4, 3, 1, 1)
    assert result["accuracy"] == pytest.approx(0.6)
    assert result["accuracy_parsed_only"] == pytest.approx(0.75)
    assert result["elapsed_seconds"] >= 0
    assert result["by_category"]["language"] == {"total": 1, "correct": 0, "accuracy": 0.0}
    assert result["by_category"]["math"] == {"total": 1, "correct": 1, "accuracy": 1.0}
    assert result["interrupted"] is False and result["stop_reason"] is None
    assert result["request_errors"] == 0
    first = result["details"][0]
    assert first == {"id": "geo1", "category": "geography", "question": "What is the capital of France?",
                     "choices": ["Berlin", "Paris", "Madrid", "Rome"], "expected": "B",
                     "predicted": "B", "correct": True, "raw_response": "B"}
    assert result["details"][4]["predicted"] is None and result["details"][4]["correct"] is False
    assert "Score: 3/5 (60.0%)" in out
    assert "parse errors: 1, accuracy on parsed answers 75.0% (3/4)" in out
    assert "saved: " + str(files[0]) in out
    assert "questions/s" in out


def test_what_is_sent(host, capsys):
    _, ctx = run(host, "/eval run example --limit 2", capsys)
    bodies = host.endpoint.requests
    assert len(bodies) == 2
    prompt = bodies[0]["history"][0]["content"]
    assert prompt == ("What is the capital of France?\n\nA) Berlin\nB) Paris\nC) Madrid\nD) Rome"
                      "\n\nAnswer with just the letter of the correct choice.")
    for body in bodies:
        assert len(body["history"]) == 1 and body["history"][0]["role"] == "user"
        assert {k: body[k] for k in support.Sampling.FIELDS} == {
            "temperature": 0.0, "top_p": 1.0, "top_k": 1, "max_new_tokens": 20,
            "repetition_penalty": 1.0, "no_repeat_ngram": 0}
    assert ctx.sampling.to_payload() == support.Sampling().to_payload()
    assert ctx.conversation == []


def test_temperature_and_max_new_flags(host, capsys):
    run(host, "/eval run example --limit 1 --temp 0.7 --max-new 5", capsys)
    body = host.endpoint.requests[0]
    assert (body["temperature"], body["top_k"], body["max_new_tokens"]) == (0.7, 0, 5)
    assert newest_result(host)["params"]["limit"] == 1


@pytest.mark.parametrize("flags, message", [
    ("--limit 0", "--limit must be at least 1"),
    ("--limit x", "--limit expects a whole number"),
    ("--limit", "--limit needs a value"),
    ("--temp -1", "--temp must be a finite number"),
    ("--temp nan", "--temp must be a finite number"),
    ("--temp inf", "--temp must be a finite number"),
    ("--max-new 0", "--max-new must be at least 1"),
    ("--workers 0", "--workers must be from 1 to 64"),
    ("--retries -1", "--retries must be from 0 to 10"),
    ("--bogus", "unknown flag --bogus"),
    ("--verbose=yes", "--verbose takes no value"),
    ("--server http://x", "--server belongs to the standalone command"),
    ("--fail-under 50", "--fail-under belongs to the standalone command"),
    ("--resume --no-save", "--resume needs the journal"),
])
def test_bad_flags_print_one_line_and_usage(host, flags, message, capsys):
    out, _ = run(host, "/eval run example " + flags, capsys)
    assert out.splitlines()[0].startswith("error: " + message)
    assert "usage: /eval" in out
    assert host.endpoint.requests == []
    assert support.results(host.plugins_path) == []


@pytest.mark.parametrize("line, message", [
    ("/eval run", "run needs a test name"),
    ("/eval info", "info needs a test name"),
    ("/eval run a b", "run: unexpected argument 'b'"),
    ("/eval list --limit 3", "--limit only goes with run and run-all"),
])
def test_bad_command_lines(host, line, message, capsys):
    out, _ = run(host, line, capsys)
    assert out.splitlines()[0] == "error: " + message


@pytest.mark.parametrize("name", ["example", "example.jsonl", "EXAMPLE_PATH"])
def test_test_name_forms(host, name, capsys):
    path = str(host.plugins_path / "evaluator" / "tests" / "example.jsonl")
    run(host, "/eval run %s --limit 1" % name.replace("EXAMPLE_PATH", path), capsys)
    assert newest_result(host)["test"] == "example"


def test_no_save_writes_nothing(host, capsys):
    out, _ = run(host, "/eval run example --no-save", capsys)
    assert os.listdir(str(host.plugins_path / "evaluator" / "results")) == []
    assert "Score: 0/5" in out


def test_verbose_lines(host, capsys):
    host.answers.update(EXAMPLE_KEY)
    out, _ = run(host, "/eval run example --verbose", capsys)
    lines = [l.split() for l in out.splitlines() if l.startswith("  ") and "expected" in l]
    assert [l[:2] for l in lines] == [["right", "geo1"], ["right", "math1"], ["right", "sci1"],
                                      ["wrong", "lang1"], ["no", "answer"]]
    assert "expected C, got A" in out and "Which of these words is a verb?" in out


def test_plain_progress_in_a_pipe(host, capsys):
    out, _ = run(host, "/eval run example", capsys)
    assert "\r" not in out and "\033" not in out
    assert "5/5 done, 0 correct (0.0%)" in out


def test_tty_gets_rolling_progress_and_colour(host, monkeypatch):
    master, slave = os.openpty()
    stream = io.TextIOWrapper(io.FileIO(slave, "w"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.delenv("NO_COLOR", raising=False)
    host.dispatch("/eval run example")
    stream.flush()
    tty_out = os.read(master, 1 << 16).decode()
    assert "\r  5/5 done" in tty_out and "ETA" in tty_out
    assert support.Color.GREEN in tty_out
    monkeypatch.setenv("NO_COLOR", "1")
    host.dispatch("/eval run example")
    stream.flush()
    plain = os.read(master, 1 << 16).decode()
    assert "\r  5/5 done" in plain and "\033[3" not in plain
    os.close(master)
    stream.close()


def test_category_breakdown_only_with_several_categories(host, capsys):
    support.add_test(host.plugins_path, "one.jsonl",
                     [{"question": "Q%d" % i, "choices": ["a", "b"], "answer": "A", "category": "c"}
                      for i in range(2)])
    out, _ = run(host, "/eval run one", capsys)
    assert "by category" not in out
    out, _ = run(host, "/eval run example", capsys)
    assert "by category" in out


def test_uncategorised_questions_have_one_key(host, capsys):
    support.add_test(host.plugins_path, "mixed.jsonl", [
        {"question": "Q1", "choices": ["a", "b"], "answer": "A"},
        {"question": "Q2", "choices": ["a", "b"], "answer": "A", "category": None},
        {"question": "Q3", "choices": ["a", "b"], "answer": "A", "category": "x"}])
    run(host, "/eval run mixed", capsys)
    assert set(newest_result(host)["by_category"]) == {"uncategorized", "x"}


def test_two_runs_never_overwrite(host, capsys):
    for _ in range(3):
        run(host, "/eval run example --limit 1", capsys)
    files = support.results(host.plugins_path)
    assert len(files) == 3
    folder = host.plugins_path / "evaluator" / "results"
    assert not [n for n in os.listdir(str(folder)) if n.endswith(".tmp")]


def test_run_all(host, capsys):
    host.answers.update(EXAMPLE_KEY)
    support.add_test(host.plugins_path, "a_two.jsonl",
                     [{"question": "Two%d" % i, "choices": ["a", "b"], "answer": "A"} for i in range(2)])
    support.add_test(host.plugins_path, "m_broken.jsonl", ['{"question": 1}'])
    out, _ = run(host, "/eval run-all", capsys)
    assert out.index("=== a_two.jsonl ===") < out.index("=== example.jsonl ===") < out.index("=== m_broken.jsonl ===")
    assert "m_broken.jsonl:1: 'question' must be a non-empty string" in out
    summary = out[out.index("Suite summary"):]
    assert "a_two.jsonl" in summary and "0/2" in summary
    assert "example.jsonl" in summary and "3/5" in summary
    assert "m_broken.jsonl  skipped" in summary
    assert "total" in summary and "3/7" in summary and "42.9%" in summary
    assert len(support.results(host.plugins_path)) == 2


def test_results_listing_and_exact_test(host, capsys):
    support.add_test(host.plugins_path, "example_v2.jsonl",
                     [{"question": "V2", "choices": ["a", "b"], "answer": "A"}])
    host.answers["V2"] = "A"
    run(host, "/eval run example --limit 2", capsys)
    run(host, "/eval run example_v2", capsys)
    out, _ = run(host, "/eval results", capsys)
    rows = [l for l in out.splitlines() if l.startswith("  ")]
    assert rows[0].split()[0].startswith("example_v2_")
    assert rows[0].split()[1:] == ["1/1", "100.0%", "model", "h2o8_preview_01"]
    assert rows[1].split()[0].startswith("example_2") and rows[1].split()[1:3] == ["0/2", "0.0%"]
    out, _ = run(host, "/eval results example", capsys)
    assert "example_v2" not in out
    assert "test name: Mini General Eval" in out and "Score: 0/2" in out
    assert "endpoint: " + host.endpoint.url in out and "parse errors: 2" in out
    out, _ = run(host, "/eval results example_v2.jsonl", capsys)
    assert "Score: 1/1" in out
    out, _ = run(host, "/eval results nothing", capsys)
    assert "No results for nothing" in out


def test_results_when_empty(host, capsys):
    out, _ = run(host, "/eval results", capsys)
    assert "No results yet" in out


# ---- model name --------------------------------------------------------------

def test_model_name_from_new_host_refreshes_once(plugins, endpoints, capsys):
    endpoint = endpoints(model="tiny-42")
    contexts = []

    def factory():
        contexts.append(support.NewContext(endpoint.url))
        return contexts[-1]
    host = support.Host(str(plugins), factory)
    host.plugins_path = plugins
    run(host, "/eval run example --limit 1", capsys)
    assert contexts[-1].refreshes == 1
    assert newest_result(host)["model"] == "tiny-42"


def test_model_name_known_to_host_is_used_without_refresh(plugins, endpoints, capsys):
    endpoint = endpoints(model="from-health")
    ctx = support.NewContext(endpoint.url)
    ctx.model_name = "from-host"
    host = support.Host(str(plugins), lambda: ctx)
    host.plugins_path = plugins
    run(host, "/eval run example --limit 1", capsys)
    assert ctx.refreshes == 0
    assert newest_result(host)["model"] == "from-host"


def test_model_name_on_old_host_reads_the_health_route(plugins, endpoints, capsys):
    endpoint = endpoints(model="old-host-model")
    host = support.Host(str(plugins), lambda: support.OldContext(endpoint.url))
    host.plugins_path = plugins
    run(host, "/eval run example --limit 1", capsys)
    assert newest_result(host)["model"] == "old-host-model"


def test_model_name_unknown_without_health_route(plugins, endpoints, capsys):
    endpoint = endpoints(health=False)
    for factory in (support.OldContext, support.NewContext):
        host = support.Host(str(plugins), lambda: factory(endpoint.url))
        host.plugins_path = plugins
        run(host, "/eval run example --limit 1", capsys)
        assert newest_result(host)["model"] == "unknown"


def test_model_name_failure_never_fails_the_run(plugins, endpoints, capsys):
    endpoint = endpoints()

    class Broken(support.NewContext):
        def refresh_health(self):
            raise RuntimeError("boom")
    host = support.Host(str(plugins), lambda: Broken(endpoint.url))
    host.plugins_path = plugins
    run(host, "/eval run example --limit 1", capsys)
    assert newest_result(host)["model"] == "unknown"


# ---- Ctrl-C ---------------------------------------------------------------------

def test_ctrl_c_saves_a_partial_result(plugins, endpoints, capsys):
    endpoint = endpoints(lambda body, n: "B")
    host = support.interrupting_host(plugins, endpoint, 3)
    out, _ = run(host, "/eval run example", capsys)
    assert "Interrupted after 2 of 5 questions" in out
    result = newest_result(host)
    assert result["interrupted"] is True
    assert [d["id"] for d in result["details"]] == ["geo1", "math1"]
    assert (result["total"], result["correct"]) == (2, 1)
    assert len(endpoint.requests) == 2


def test_ctrl_c_with_no_save_writes_nothing(plugins, endpoints, capsys):
    host = support.interrupting_host(plugins, endpoints(), 2)
    run(host, "/eval run example --no-save", capsys)
    assert os.listdir(str(plugins / "evaluator" / "results")) == []


def test_ctrl_c_stops_run_all_and_prints_the_summary(plugins, endpoints, capsys):
    host = support.interrupting_host(plugins, endpoints(), 4)
    support.add_test(plugins, "a_first.jsonl",
                     [{"question": "F%d" % i, "choices": ["a", "b"], "answer": "A"} for i in range(2)])
    support.add_test(plugins, "z_last.jsonl", [{"question": "L", "choices": ["a", "b"], "answer": "A"}])
    out, _ = run(host, "/eval run-all", capsys)
    summary = out[out.index("Suite summary"):]
    assert "a_first.jsonl" in summary and "example.jsonl" in summary and "(stopped early)" in summary
    assert "z_last" not in out
    assert len(support.results(plugins)) == 2


def test_nothing_escapes_handle(plugins, capsys):
    class Exploding(support.NewContext):
        @property
        def server_url(self):
            raise RuntimeError("host bug")

        @server_url.setter
        def server_url(self, value):
            pass
    host = support.Host(str(plugins), lambda: Exploding("http://127.0.0.1:9"))
    host.dispatch("/eval run example")
    assert host.errors == []
    assert "evaluator: internal error: RuntimeError: host bug" in capsys.readouterr().out


def test_files_get_the_usual_permissions(host, capsys):
    old = os.umask(0o022)
    try:
        run(host, "/eval run example --limit 1", capsys)
    finally:
        os.umask(old)
    [path] = support.results(host.plugins_path)
    assert stat.S_IMODE(os.stat(str(path)).st_mode) == 0o644
